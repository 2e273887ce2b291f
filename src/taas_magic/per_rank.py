"""One name's values from several ranks, as they arrive in the notebook (``taas.PerRank``), and the
wording of a set of ranks that every message of taas shares ("ranks 0-3,5").

``--return NAMES --from all`` and a session's ``%taas pull NAMES`` bring a name back from each rank it
is asked of; the notebook then holds one ``PerRank`` per name. It reads like the list of the ranks'
values (``x[1]``, ``for value in x``, ``len(x)``) and shows each distinct value once with the ranks
that hold it, since ranks mostly agree and eight copies of the same tensor say nothing.
"""

from __future__ import annotations

import sys
from typing import Generic, Hashable, Iterable, Iterator, Mapping, TypeVar

T = TypeVar("T")


def span(keys: Iterable[Hashable]) -> str:
    """ "rank 3", "ranks 0-2,4-7": the ranks among ``keys`` (others are left out), in runs."""
    numbers = sorted({key for key in keys if isinstance(key, int)})
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    text = ",".join(f"{low}" if low == high else f"{low}-{high}" for low, high in runs)
    return ("rank " if len(numbers) == 1 else "ranks ") + text


class PerRank(Generic[T]):
    """A name's value in each of several ranks: ``x[rank]``, iteration in rank order, ``len(x)``,
    ``x.ranks`` and ``x.items()``.

    Indexing is by rank number, so after ``--from 1,3`` ``x[1]`` and ``x[3]`` are the values and
    ``x[0]`` is an error naming the ranks there are.
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[int, T]):
        self._values = dict(sorted(values.items()))

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks the values came from, in order."""
        return tuple(self._values)

    def items(self) -> list[tuple[int, T]]:
        """(rank, value) pairs in rank order."""
        return list(self._values.items())

    def __getitem__(self, rank: int) -> T:
        try:
            return self._values[rank]
        except (KeyError, TypeError):
            raise KeyError(f"{rank!r} is not a rank of this value: it holds {span(self._values)}") from None

    def __iter__(self) -> Iterator[T]:
        return iter(self._values.values())

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PerRank):
            return NotImplemented
        return self.ranks == other.ranks and all(_equal(a, b) for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # its values may change: like a list, it is not hashable

    def __repr__(self) -> str:
        groups: dict[str, list[int]] = {}
        for rank, value in self._values.items():
            groups.setdefault(_shown(value), []).append(rank)
        if not groups:
            return "PerRank(no ranks)"
        lines = []
        for shown, ranks in groups.items():
            head = f"{span(ranks)}:"
            lines.append(f"{head} {shown}" if "\n" not in shown else head + "\n" + _indent(shown))
        return "\n".join(lines)

    def _repr_pretty_(self, printer: object, cycle: bool) -> None:
        """IPython's display: the same text as ``repr``."""
        printer.text("PerRank(...)" if cycle else repr(self))  # type: ignore[attr-defined]


def _shown(value: object) -> str:
    try:
        return repr(value)
    except Exception as e:  # a value whose repr fails still shows, as what it is
        return f"<{type(value).__name__} whose repr raised {type(e).__name__}>"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _equal(a: object, b: object) -> bool:
    """Whether two ranks' values are the same: tensors and arrays by their values, anything else by ``==``."""
    if a is b:
        return True
    torch = sys.modules.get("torch")  # a tensor in hand means torch is imported
    if torch is not None and (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    try:
        return bool(a == b)
    except Exception:  # arrays (ambiguous truth), objects whose == raises
        try:
            return bool((a == b).all())  # type: ignore[attr-defined]
        except Exception:
            return False
