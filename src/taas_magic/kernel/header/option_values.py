"""What each `%%taas` option's value may be, read from what the user typed: converters that raise
``ArgumentTypeError`` with the value (cut short when long) and what is allowed, so a bad value ends as one
line before anything starts; ranks as typed, for messages that quote them.
"""

from __future__ import annotations

import argparse
import re
from typing import Callable, Iterable, Sequence

# ASCII digits only: these are what a user types, and what error messages can show back.
_WHOLE = re.compile(r"-?[0-9]+")
_NATURAL = re.compile(r"[0-9]+")
ALL = "all"  # --from all: every rank
_DECIMAL = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_NOT_FINITE = re.compile(r"-?(?:nan|inf|infinity)", re.IGNORECASE)  # parsed only to be refused by name


def whole_number(low: int, high: int | None = None, note: str = "") -> Callable[[str], int]:
    def convert(text: str) -> int:
        allowed = f"{low}-{high}" if high is not None else f"a whole number of {low} or more"
        # Plain ASCII digits only: int() also takes "２", "٢", "0_2" and "+2".
        if not _WHOLE.fullmatch(text):
            raise argparse.ArgumentTypeError(f"{shortened(text)!r} is not a whole number: use {allowed}{note}")
        digits = text.lstrip("0") or "0"
        value = int(digits) if len(digits) <= 30 else None  # no count has 30 digits; int() stops at 4300
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{shortened(text)} is out of range: use {allowed}{note}")
        return value

    return convert


def seconds(text: str) -> float:
    """Plain decimal seconds (``1.5``, ``2e-3``); float() would also take "1_0", "٢" or " 2 "."""
    if not (_DECIMAL.fullmatch(text) or _NOT_FINITE.fullmatch(text)):
        raise argparse.ArgumentTypeError(
            f"{shortened(text)!r} is not a number of seconds: use a number of seconds greater than 0"
        )
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{shortened(text)} is not allowed: use a number of seconds greater than 0")
    return value


def seconds_or_off(text: str) -> float:
    """Seconds, or 0 for off (``--hang-after 0``)."""
    if text.strip() in ("0", "0.0"):
        return 0.0
    try:
        return seconds(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{shortened(text)!r} is not allowed: use a number of seconds greater than 0, or 0 to turn it off"
        ) from None


def shortened(text: str, keep: int = 40) -> str:
    """A value as an error message shows it: cut short when long."""
    return text if len(text) <= keep else text[:keep] + "..."


# IPython's own names in the notebook's namespace: its history (In, Out, _, _i1, _1, …), exit, quit, get_ipython.
_KERNELS_OWN = frozenset(
    {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_i", "_ii", "_iii", "_ih", "_oh", "_dh"}
)
_HISTORY = re.compile(r"_i?[0-9]+")


def kernels_own(name: str) -> bool:
    """A name Python or IPython keeps in the notebook's namespace, not a value of the user's: moving it would
    replace what every later cell relies on (``__builtins__`` holds ``print`` itself)."""
    return name in _KERNELS_OWN or bool(_HISTORY.fullmatch(name)) or (name.startswith("__") and name.endswith("__"))


def refuse_kernels_own(names: Iterable[str]) -> None:
    """One line for the first name of ``names`` that is the kernel's own (``ValueError``)."""
    own = next((name for name in names if kernels_own(name)), None)
    if own is not None:
        raise ValueError(
            f"{shortened(own)!r} is the kernel's own name, not a value of the notebook's (dunder names, In, "
            "Out, _, _i1, _1, exit, quit and get_ipython stay where they are)"
        )


def names_or_none(text: str) -> tuple[str, ...]:
    if text.strip().lower() == "none":
        return ()
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    bad = [name for name in names if not name.isidentifier()]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{shortened(text)!r} is not a list of names: use a,b,c or none")
    try:
        refuse_kernels_own(names)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return names


class Ranks(tuple[int, ...]):
    """Ranks from an option, with the option's value as typed: errors quote what the user wrote."""

    typed: str

    def __new__(cls, ranks: Iterable[int], typed: str) -> "Ranks":
        made = super().__new__(cls, ranks)
        made.typed = shortened(typed.strip())
        return made


def rank_list(text: str) -> Ranks:
    """``0``, ``0,2`` or ``0-3,6``: ranks, each once, in the order given."""
    ranks: list[int] = []
    for word in (word.strip() for word in text.split(",")):
        low, dash, high = word.partition("-")
        if not _NATURAL.fullmatch(low) or (dash and not _NATURAL.fullmatch(high)) or (dash and int(high) < int(low)):
            raise argparse.ArgumentTypeError(
                f"{shortened(text)!r} is not a list of ranks: use a rank number, several "
                "separated by commas (0,2), or a range (0-3)"
            )
        first, last = _rank_number(low), _rank_number(high if dash else low)
        ranks.extend(range(first, min(last, first + 10**6) + 1))
    if len(set(ranks)) != len(ranks):
        raise argparse.ArgumentTypeError(f"{shortened(text)!r} names a rank twice: name each once")
    return Ranks(ranks, text)


def _rank_number(word: str) -> int:
    return int(word) if len(word) <= 100 else 10**100  # a huge number is out of range all the same


def ranks_as_typed(ranks: Sequence[int]) -> str:
    """Ranks as the user typed them (``Ranks``), else written out: "0-3", "0,2"."""
    return ranks.typed if isinstance(ranks, Ranks) else ",".join(map(str, ranks))


def rank_text(rank: int) -> str:
    """One rank number for a message, a huge one cut short."""
    return shortened(str(rank))


def ranks_or_all(text: str) -> Ranks | str:
    """``--from``: ``all``, or ranks as ``rank_list`` reads them."""
    return ALL if text.strip().lower() == ALL else rank_list(text)


def count(number: int, unit: str) -> str:
    """``3 ranks``, ``1 rank``."""
    return f"{number} {unit}{'' if number == 1 else 's'}"
