"""Where a run's processes are, and why they do not move: pure functions from what they reported.

Each rank samples what its cell is doing (``RankActivity``: the collectives it is in, the last it
finished, the loader it waits for, process-group setup) and, when asked, every process dumps its
threads' stacks. This module reads the two together for the three moments a person needs them —
the watchdog's "no progress for N s", ``--timeout``, and an interrupt or a failure whose peers are
stuck — and says it once for all ranks that are at the same place:

    ranks 0-2,4-7: in all_reduce #1235 (4 MB float32) for 118 s
        Cell In[7], line 14 in <module>
          dist.all_reduce(grads)
    rank 3: finished #1234, in no collective
        Cell In[7], line 12 in <module>
          time.sleep(600)

and, for the watchdog, the likely cause in one line (``cause``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Mapping, Sequence, TypeVar

from taas_magic.kernel.diagnosis.stacks import Frame, Thread, parse_stacks, stack_lines
from taas_magic.per_rank import span
from taas_magic.wire.events import Key, key_order
from taas_magic.wire.records import Collective, RankActivity

Same = TypeVar("Same", bound=Hashable)
# A rank that spent this share of a core outside collectives and data waits is computing. A waiting rank
# spends next to nothing; one computing on a machine shared with other work may get far less than a core.
COMPUTING = 0.05
_SETUP_FUNCTIONS = (
    "init_process_group",
    "_store_based_barrier",
    "rendezvous",
    "_env_rendezvous_handler",
    "_new_process_group_helper",
)


@dataclass(frozen=True)
class Process:
    """One process of the run as the diagnosis sees it."""

    key: Key
    label: str  # "rank 3", "producer 0 of train_loader"
    activity: RankActivity | None = None  # its latest sample
    age: float = 0.0  # seconds since that sample was taken
    stack: str = ""  # its faulthandler dump ("" if none came)
    ended: str = ""  # how it left, if it did: "had finished the cell", "exited with code 1"
    node: int | None = None  # its node's index on a cluster

    def collective(self) -> Collective | None:
        """The oldest collective it is in: the one the others wait for, or it for them. One its sample
        names by number alone (entered just before it) is named by the call its stack shows."""
        if self.activity is None or not self.activity.collectives:
            return None
        collective = self.activity.collectives[0]
        if not collective.op and self.in_collective_call():
            return dataclasses.replace(collective, op=self.in_collective_call())
        return collective

    @functools.cached_property
    def threads(self) -> list[Thread]:
        """Its stack, read once: the diagnosis asks it again and again."""
        return parse_stacks(self.stack)

    def innermost(self, cell_names: Mapping[str, str]) -> Frame | None:
        """The innermost frame of the user's code in its main thread (else its innermost frame)."""
        threads = self.threads
        if not threads or not threads[0].frames:
            return None
        frames = threads[0].frames
        return next((frame for frame in frames if frame.user(cell_names)), frames[0])

    def in_setup(self) -> bool:
        if self.activity is not None and self.activity.setup is not None:
            return True
        threads = self.threads
        return bool(threads) and any(
            frame.function in _SETUP_FUNCTIONS and "/torch/distributed/" in frame.file for frame in threads[0].frames
        )

    def in_collective_call(self) -> str:
        """The torch.distributed collective its main thread is inside, by its stack ("" if none): a rank in
        its first second may not have said so in a sample yet."""
        threads = self.threads
        frames = threads[0].frames if threads else ()
        return next(
            (
                frame.function
                for frame in reversed(frames)
                if frame.function not in _SETUP_FUNCTIONS
                and frame.file.endswith("/torch/distributed/distributed_c10d.py")
            ),
            "",
        )

    def seconds(self, of: float | None) -> float:
        """A sampled duration, brought up to now."""
        return (of or 0.0) + self.age


# -- what each process is doing ---------------------------------------------------------------------
def progressed(before: RankActivity | None, sample: RankActivity) -> bool:
    """Whether a rank's new sample shows progress since its last (``before``; None: its first): a collective
    finished or entered, an element taken, or CPU spent outside collectives and data waits (a computation)."""
    if before is None:
        return True
    position = (sample.finished, [(c.group, c.seq) for c in sample.collectives], sample.taken)
    if position != (before.finished, [(c.group, c.seq) for c in before.collectives], before.taken):
        return True
    return computing(before, sample)


def computing(before: RankActivity, after: RankActivity) -> bool:
    """Between two samples of a rank: CPU spent outside collectives, data waits and setup."""
    waiting = after.collectives or after.waiting or after.setup is not None
    span = after.at - before.at
    return not waiting and span > 0 and (after.cpu - before.cpu) / span >= COMPUTING


def doing(process: Process) -> str:
    """One phrase: "in all_reduce #1235 (4 MB float32) for 12 s", "waiting for data from train_loader for 3 s"."""
    what, seconds = _doing(process)
    return what + _lasting(seconds)


def _lasting(seconds: float | None) -> str:
    """The duration as a diagnosis says it (" for 12 s"); nothing when it is not known, or too short to read as
    a whole second (a collective entered just then)."""
    return f" for {seconds:.0f} s" if seconds is not None and seconds >= 0.5 else ""


def _doing(process: Process) -> tuple[str, float | None]:
    """What a process does, and for how long (None: not known); its tensors said once known."""
    if process.ended:
        return process.ended, None
    if not isinstance(process.key, int):
        return "", None  # a producer: its stack says what it does
    activity = process.activity
    collective = process.collective()
    if collective is not None:
        return f"in {describe(collective)}", process.seconds(collective.seconds) if collective.op else None
    if activity is not None and activity.waiting:
        return f"waiting for data from {activity.waiting}", process.seconds(activity.waited)
    if process.in_setup():
        setup = activity.setup if activity is not None else None
        return "in process-group setup", None if setup is None else process.seconds(setup)
    if process.in_collective_call():
        return f"in {process.in_collective_call()}", None
    done = ", ".join(
        f"#{seq}" if group == "0" else f"#{seq} of group {group}"
        for group, seq in sorted((activity.finished if activity else {}).items())
        if seq > 0
    )
    return (f"finished {done}, in no collective" if done else "in no collective"), None


def describe(collective: Collective) -> str:
    """ "all_reduce #1235 (4 MB float32)"; "send #3 (p2p)"."""
    number = f"#{collective.seq}" + (" (p2p)" if collective.p2p else "")
    group = "" if collective.group in ("0", "") else f" of group {collective.group}"
    return f"{collective.op or 'a collective'} {number}{group}" + (
        f" ({tensors(collective)})" if collective.shapes else ""
    )


def tensors(collective: Collective) -> str:
    """The size and type of its tensors: "4 MB float32"; shapes when sizes alone do not tell them apart."""
    if not collective.shapes:
        return "no tensors"
    size = sum(_bytes_of(shape, dtype) for shape, dtype in zip(collective.shapes, collective.dtypes))
    dtypes = sorted({_dtype_name(dtype) for dtype in collective.dtypes})
    return f"{_bytes(size)} {'/'.join(dtypes)}"


def shapes(collective: Collective) -> str:
    return ", ".join(
        f"[{', '.join(map(str, shape))}] {_dtype_name(dtype)}"
        for shape, dtype in zip(collective.shapes, collective.dtypes)
    )


# -- the likely cause ---------------------------------------------------------------------------------
def cause(processes: Sequence[Process], cell_names: Mapping[str, str]) -> str:
    """The likely reason no rank moves, in one line."""
    ranks = [p for p in processes if isinstance(p.key, int)]
    running = [p for p in ranks if not p.ended]
    if not running:
        return "no rank is running"
    in_collective = [p for p in running if p.collective() is not None]
    if in_collective:
        return _collective_cause(ranks, in_collective, cell_names)
    setup = [p for p in running if p.in_setup()]
    if setup:
        return _setup_cause(ranks, setup, cell_names)
    waiting = [p for p in running if p.activity is not None and p.activity.waiting]
    if waiting and len(waiting) == len(running):
        loaders = sorted({p.activity.waiting for p in waiting if p.activity is not None})
        return (
            f"every rank waits for data from {', '.join(loaders)}: {'its' if len(loaders) == 1 else 'their'} "
            f"producers sent nothing for "
            f"{min(p.seconds(p.activity.waited if p.activity else 0) for p in waiting):.0f} s"
        )
    return (
        f"no rank is in a collective: {_where_each(running, cell_names)}; they wait in the code itself, "
        "on a sleep, a lock or a queue"
    )


def _collective_cause(ranks: Sequence[Process], inside: Sequence[Process], cell_names: Mapping[str, str]) -> str:
    by_position: dict[tuple[str, int, bool], list[Process]] = {}
    for process in inside:
        collective = process.collective()
        assert collective is not None
        by_position.setdefault((collective.group, collective.seq, collective.p2p), []).append(process)
    for position, group in sorted(by_position.items()):
        described = [p for p in group if _collective(p).op]  # one a rank entered just now is named by number alone
        ops: dict[str, list[Process]] = {}
        for process in described:
            ops.setdefault(_collective(process).op, []).append(process)
        if len(ops) > 1:
            parts = [
                f"{span(p.key for p in members)} {'are' if len(members) > 1 else 'is'} in {op} #{position[1]}"
                for op, members in sorted(ops.items(), key=lambda item: key_order(item[1][0].key))
            ]
            return f"the ranks called different collectives: {' and '.join(parts)}"
        calls: dict[str, list[Process]] = {}
        for process in (p for p in described if _collective(p).shapes):
            calls.setdefault(shapes(_collective(process)), []).append(process)
        if len(calls) > 1:
            op = next(iter(ops))
            parts = [
                f"{span(p.key for p in members)} with {call}"
                for call, members in sorted(calls.items(), key=lambda item: key_order(item[1][0].key))
            ]
            return f"the ranks called {op} #{position[1]} with different tensors: {'; '.join(parts)}"
    # The collective most ranks wait in, and who is not in it.
    position, waiting = max(by_position.items(), key=lambda item: (len(item[1]), item[0][1]))
    first = max((_collective(p) for p in waiting), key=lambda c: bool(c.op))  # a described one, if any
    missing = [p for p in ranks if p not in waiting and _in_group(p, first)]
    if not missing:
        every = "every rank" if first.group in ("0", "") else f"every rank of group {first.group}"
        return (
            f"{every} is in {describe(first)}: the backend itself does not complete it "
            "(a network or driver problem; NCCL_DEBUG=INFO or TORCH_CPP_LOG_LEVEL=INFO say more)"
        )
    verb = "has" if len(missing) == 1 else "have"
    return (
        f"{span(p.key for p in missing)} {verb} not entered {first.op or 'collective'} #{first.seq} that "
        f"{span(p.key for p in waiting)} wait{'s' if len(waiting) == 1 else ''} in; "
        + _where_each(missing, cell_names, pronoun=True)
    )


def _setup_cause(ranks: Sequence[Process], setup: Sequence[Process], cell_names: Mapping[str, str]) -> str:
    store = next((p.activity.store for p in setup if p.activity is not None and p.activity.store), "")
    at = f" at the store {store}" if store else ""
    missing = [p for p in ranks if p not in setup]
    if not missing:
        return (
            f"every rank waits in process-group setup{at} and all of them joined it: the backend cannot "
            "connect its ranks (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME choose the network)"
        )
    return (
        f"{span(p.key for p in setup)} wait{'s' if len(setup) == 1 else ''} in process-group setup{at} for "
        f"{span(p.key for p in missing)}, which {'has' if len(missing) == 1 else 'have'} not joined: "
        + _where_each(missing, cell_names, pronoun=True)
    )


def _elsewhere(process: Process, cell_names: Mapping[str, str]) -> str:
    """What a rank does that is not where the others wait, said of one rank:
    "is at Cell In[7], line 12 (time.sleep(600))"."""
    if process.ended:
        return process.ended
    collective = process.collective()
    if collective is not None:
        return f"is in {describe(collective)}"
    if process.activity is not None and process.activity.waiting:
        return f"waits for data from {process.activity.waiting}"
    frame = process.innermost(cell_names)
    if frame is None:
        return "sent no stack"
    source = frame.source()
    return f"is at {frame.where(cell_names)}" + (f" ({source})" if source else "")


_PLURAL = {"is": "are", "waits": "wait", "has": "have", "was": "were"}


def _said_of(who: Sequence[Process], predicate: str, pronoun: bool = False) -> str:
    """``predicate`` (said of one rank) with its subject: "rank 3 is at …", "they are at …"."""
    plural = len(who) > 1
    verb, _, rest = predicate.partition(" ")
    if plural and verb in _PLURAL:
        predicate = f"{_PLURAL[verb]} {rest}"
    subject = ("they" if plural else "it") if pronoun else span(p.key for p in who)
    return f"{subject} {predicate}"


def _where_each(processes: Sequence[Process], cell_names: Mapping[str, str], pronoun: bool = False) -> str:
    groups = _group_by(processes, lambda p: _elsewhere(p, cell_names))
    if len(groups) == 1 and pronoun:
        return _said_of(groups[0][1], groups[0][0], pronoun=True)
    return "; ".join(_said_of(members, where) for where, members in groups)


def _in_group(process: Process, collective: Collective) -> bool:
    """Whether the rank belongs to the collective's process group (every rank is in the default one)."""
    if collective.group in ("0", ""):
        return True
    activity = process.activity
    return activity is not None and (
        collective.group in activity.finished or any(c.group == collective.group for c in activity.collectives)
    )


def _collective(process: Process) -> Collective:
    collective = process.collective()
    assert collective is not None
    return collective


# -- grouped stacks -------------------------------------------------------------------------------------
def where_lines(processes: Sequence[Process], cell_names: Mapping[str, str], ranks_per_node: int = 0) -> list[str]:
    """Each place some processes are, once: who is there, what they do (for as long as the longest of
    them has), and the stack they share."""
    lines: list[str] = []
    for stack, members in _group_by(processes, lambda p: tuple(stack_lines(p.stack, cell_names))):
        by_doing = _group_by(members, lambda p: (_place(p), bool(p.ended)))
        if stack and len(by_doing) > 1:  # one place, several positions: every rank there is named with the stack
            doings = "; ".join(f"{_who(group, 0)} {_what(group)}".rstrip() for _, group in by_doing)
            lines.append(f"{_who(members, ranks_per_node)}: {doings}:")
        else:
            for (_, ended), group in by_doing:
                what = _what(group)
                lines.append(f"{_who(group, ranks_per_node)}" + (f": {what}" if what else "") + (":" if stack else ""))
                if not stack and not ended:
                    lines.append("    (no stack received)")
        lines += stack
    return lines


def _what(group: Sequence[Process]) -> str:
    """What processes at one place do, for as long as the longest of them has."""
    what = max((_doing(p)[0] for p in group), key=len)  # with its tensors, if one sample told them
    longest = max((seconds for seconds in (_doing(p)[1] for p in group) if seconds is not None), default=None)
    return what + _lasting(longest)


def _place(process: Process) -> str:
    """What a process does, less what one sample may tell and another not: in the same collective,
    ranks are one group whether or not their last sample described its tensors."""
    collective = process.collective()
    if collective is not None and not process.ended:
        return f"in {collective.op} #{collective.seq} of {collective.group}{' (p2p)' if collective.p2p else ''}"
    return _doing(process)[0]


def _who(processes: Sequence[Process], ranks_per_node: int) -> str:
    ranks = [p for p in processes if isinstance(p.key, int)]
    others = [p.label for p in processes if not isinstance(p.key, int)]
    parts = []
    if ranks:
        parts.append(span(p.key for p in ranks))
        nodes = sorted(
            {
                p.node if p.node is not None else int(p.key) // ranks_per_node
                for p in ranks
                if ranks_per_node and isinstance(p.key, int)
            }
        )
        if nodes:
            parts[-1] += f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})"
    return "; ".join(parts + others)


def _group_by(processes: Iterable[Process], identity: Callable[[Process], Same]) -> list[tuple[Same, list[Process]]]:
    """Processes grouped by ``identity(process)``, groups in the order of their first member."""
    groups: dict[Same, list[Process]] = {}
    for process in sorted(processes, key=lambda p: key_order(p.key)):
        groups.setdefault(identity(process), []).append(process)
    return list(groups.items())


# -- sizes ---------------------------------------------------------------------------------------------
_DTYPE_BYTES = {
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
}
_DTYPE_NAMES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
}


def _dtype_name(dtype: str) -> str:
    return _DTYPE_NAMES.get(dtype, dtype.lower())


def _bytes_of(shape: Sequence[int], dtype: str) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * _DTYPE_BYTES.get(dtype, 4)


def _bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.3g} {unit}"
        count /= 1000
    return f"{count:.3g} TB"


@dataclass(frozen=True)
class Hang:
    """What the watchdog found: the run made no progress for ``stalled`` seconds."""

    stalled: float
    processes: tuple[Process, ...]
    after: float  # --hang-after
    ranks_per_node: int = 0  # > 0 on a cluster
