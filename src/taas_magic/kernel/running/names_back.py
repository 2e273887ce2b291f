"""The end of a cell: the names the ranks sent back join the notebook, and one line says what did not.

From one rank a name comes back as it is; from several (``--from``) as a ``taas.PerRank``. A name that a
rank could not send (or the kernel could not unpickle) stays out, and the line that names it says why.
"""

from __future__ import annotations

import builtins
import sys
from typing import Any

from taas_magic.kernel.run.run_result import RunResult
from taas_magic.per_rank import PerRank, span
from taas_magic.wire import results

NOT_IN_THE_RANK = "the rank has no such name"  # a name %taas pull asked for, which the rank never bound
# A name the rank did not send while its cell runs in the background: it has none, or it cannot be sent without a
# collective of its own (a sharded tensor), or it does not pickle.
NOT_SENT_WHILE_RUNNING = "the rank has no such name, or cannot send it while its cell runs"


def take_back(
    namespace: dict[str, Any],
    result: RunResult,
    requested: tuple[str, ...] | None,
    from_ranks: tuple[int, ...],
    pulled: bool = False,
) -> dict[str, Any]:
    """Put the sending ranks' names into ``namespace``, and return them. Names a rank never bound are
    said to be missing only if they were asked for by name (``requested``); ``pulled``: by ``%taas pull``,
    which has no cell that ended. A name that now hides a builtin of the notebook's is said in one line."""
    taken: dict[int, dict[str, Any]] = {}
    left: dict[tuple[str, str], list[int]] = {}  # (name, why) -> the ranks it did not come back from
    for rank in from_ranks:
        skipped = results.worth_saying(dict(result.skipped.get(rank, {})), requested)
        if pulled:
            skipped = {name: NOT_IN_THE_RANK if why == results.NOT_BOUND else why for name, why in skipped.items()}
        try:
            taken[rank], lost = results.loads(result.results.get(rank, b""))
        except Exception as e:  # the stream itself is damaged: no name can be read
            taken[rank], lost = {}, {"(all)": f"could not be unpickled in the kernel: {type(e).__name__}: {e}"}
        for name, why in {**skipped, **lost}.items():
            left.setdefault((name, why), []).append(rank)
    values = _one_per_name(taken, several=len(from_ranks) > 1)
    hiding = _hiding_builtins(values, namespace)
    namespace.update(values)  # each name that could be unpickled, whatever became of the others
    if left:
        print(f"taas: not copied back {_left_behind(left)}", file=sys.stderr)
    if hiding:
        print(_hiding_notice(hiding, from_ranks), file=sys.stderr)
    return values


def take_back_pulled(
    namespace: dict[str, Any], answers: dict[int, Any], requested: tuple[str, ...], from_ranks: tuple[int, ...]
) -> dict[str, Any]:
    """``%taas pull`` while a cell runs: the names the ranks sent between two steps (``answers``) join ``namespace``,
    as ``take_back`` puts a cell's; a name a rank did not send (it has none, or its value could not be sent while
    its cell runs: a sharded tensor, a value that does not pickle) is said in one line."""
    taken: dict[int, dict[str, Any]] = {}
    left: dict[tuple[str, str], list[int]] = {}
    for rank in from_ranks:
        try:
            taken[rank], lost = results.loads(answers.get(rank, b""))
        except Exception as e:
            taken[rank], lost = {}, {"(all)": f"could not be unpickled in the kernel: {type(e).__name__}: {e}"}
        missing = {name: NOT_SENT_WHILE_RUNNING for name in requested if name not in taken[rank] and name not in lost}
        for name, why in {**missing, **lost}.items():
            left.setdefault((name, why), []).append(rank)
    values = _one_per_name(taken, several=len(from_ranks) > 1)
    hiding = _hiding_builtins(values, namespace)
    namespace.update(values)
    if left:
        print(f"taas: not copied back {_left_behind(left)}", file=sys.stderr)
    if hiding:
        print(_hiding_notice(hiding, from_ranks), file=sys.stderr)
    return values


def _hiding_builtins(values: dict[str, Any], namespace: dict[str, Any]) -> list[str]:
    """The names that come back and will hide a Python builtin the notebook used until now (``list``, ``sum``)."""
    return [
        name
        for name, value in values.items()
        if name not in namespace and hasattr(builtins, name) and value is not getattr(builtins, name)
    ]


def _hiding_notice(names: list[str], from_ranks: tuple[int, ...]) -> str:
    listed = ", ".join(names)
    one = len(names) == 1
    return (
        f"taas: {listed} came back from {span(from_ranks)} and now {'hides' if one else 'hide'} Python's "
        f"builtin{'' if one else 's'} of the same name in the notebook: del {names[0]} brings "
        f"{'it' if one else 'each'} back"
    )


def _one_per_name(taken: dict[int, dict[str, Any]], several: bool) -> dict[str, Any]:
    """Each name's value: the one rank's, or a ``PerRank`` of the ranks it came back from."""
    if not several:
        return next(iter(taken.values()), {})
    names = dict.fromkeys(name for values in taken.values() for name in values)
    return {name: PerRank({rank: values[name] for rank, values in taken.items() if name in values}) for name in names}


def _left_behind(left: dict[tuple[str, str], list[int]]) -> str:
    """ "from rank 0: x (why); y (why)": what did not come back, grouped by the ranks it stayed in."""
    by_ranks: dict[str, list[str]] = {}
    for (name, why), ranks in left.items():
        by_ranks.setdefault(span(ranks), []).append(f"{name} ({why})")
    return "; ".join(f"from {ranks}: {'; '.join(names)}" for ranks, names in by_ranks.items())
