"""The end of a cell: the names the ranks sent back join the notebook, and one line says what did not.

From one rank a name comes back as it is; from several (``--from``) as a ``taas.PerRank``. A name that a
rank could not send (or the kernel could not unpickle) stays out, and the line that names it says why.
"""

from __future__ import annotations

import sys
from typing import Any

from taas_magic.kernel.run_result import RunResult
from taas_magic.per_rank import PerRank, span
from taas_magic.wire import results


def take_back(
    namespace: dict[str, Any], result: RunResult, requested: tuple[str, ...] | None, from_ranks: tuple[int, ...]
) -> dict[str, Any]:
    """Put the sending ranks' names into ``namespace``, and return them. Names a rank never bound are
    said to be missing only if they were asked for by name (``requested``)."""
    taken: dict[int, dict[str, Any]] = {}
    left: dict[tuple[str, str], list[int]] = {}  # (name, why) -> the ranks it did not come back from
    for rank in from_ranks:
        skipped = results.worth_saying(dict(result.skipped.get(rank, {})), requested)
        try:
            taken[rank], lost = results.loads(result.results.get(rank, b""))
        except Exception as e:  # the stream itself is damaged: no name can be read
            taken[rank], lost = {}, {"(all)": f"could not be unpickled in the kernel: {type(e).__name__}: {e}"}
        for name, why in {**skipped, **lost}.items():
            left.setdefault((name, why), []).append(rank)
    values = _one_per_name(taken, several=len(from_ranks) > 1)
    namespace.update(values)  # each name that could be unpickled, whatever became of the others
    if left:
        print(f"taas: not copied back {_left_behind(left)}", file=sys.stderr)
    return values


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
