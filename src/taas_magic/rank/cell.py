"""One cell's code in a rank: run it, and say how it ended (a record, rank 0's names, the error).

A one-shot rank runs one cell (``worker.py``), a session's rank one after another (``session.py``);
both end each cell here, so a failure or an early ``sys.exit`` reads the same in either.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from taas_magic.errors import ProducersGone
from taas_magic.process.child import EXIT_FAILED, EXIT_INTERRUPTED, flush_all
from taas_magic.process.containment import HeldTermination
from taas_magic.process.tracebacks import format_traceback, frames_as_dump
from taas_magic.rank import profiling, progress, sharded, visual_debugging, vitals
from taas_magic.wire import results
from taas_magic.wire.records import CellEnded, DeliverySummary, Failed
from taas_magic.wire.task import CellOrder, LoaderPlan, RankTask, Returns

Report = Callable[[Failed], None]


def run_cell(
    order: CellOrder,
    namespace: dict[str, Any],
    shell: Any,
    task: RankTask,
    served: tuple[LoaderPlan, ...],
    report_early: Report | None = None,
) -> tuple[int, CellEnded | Failed, results.Packed | None, BaseException | None]:
    """Run one cell as ``order`` says: (exit status, how it ended, the pickled names this rank sends back,
    the error it raised). The names are None in a rank that sends none (``order.returns``). ``served``: the
    registered loaders whose stand-ins the rank holds, each summed up for the cell. ``report_early``: how a
    one-shot rank says at once that a peer's loss broke it (see ``_failure``)."""
    assert order.code is not None  # an order without code opens the debugger instead (rank/session.py)
    _delivery_summaries(served, namespace)  # a session cell sums up its own loops, not those of one that failed
    exited = None  # how the cell ended early without failing: "sys.exit(0)"
    try:
        try:
            with vitals.sampling(), profiling.profiled(task.traces_folder(order), task.device):
                visual_debugging.take_part(order.debugging, int(os.environ.get("RANK", "0")))
                exec(order.code, namespace)
        finally:
            progress.flush()
    except SystemExit as e:
        if isinstance(e.__context__, KeyboardInterrupt) and e.code not in (None, 0):
            # PyTorch Lightning ends an interrupted fit with sys.exit(1), once it has shut down: an interrupt still
            return _failure(e.__context__, shell, task, report_early=report_early) + (None, e.__context__)
        if e.code not in (None, 0):
            return _failure(e, shell, task, f"the cell called sys.exit({e.code!r})") + (None, e)
        exited = "sys.exit()" if e.code is None else f"sys.exit({e.code!r})"
    except BaseException as e:
        return _failure(e, shell, task, report_early=report_early) + (None, e)
    ended = time.monotonic()  # compared with other ranks' failures: did this rank leave before them?
    data, skipped = _results(order.returns, namespace)
    return 0, CellEnded(ended, skipped, _delivery_summaries(served, namespace), exited or ""), data, None


def failed_outside_code(error: BaseException, shell: Any, task: RankTask) -> tuple[int, Failed]:
    """How a session's cell ended that failed outside its code: an interrupt before the code began, the process
    group not connected again."""
    return _failure(error, shell, task)


def _delivery_summaries(served: tuple[LoaderPlan, ...], namespace: dict[str, Any]) -> dict[str, DeliverySummary]:
    """How each stand-in loader the cell iterated fared in this rank: elements received, time spent waiting. A name
    served twice (rebound to another registered loader) is asked once: its stand-in's summary is taken as it is
    read."""
    names = dict.fromkeys(plan.name for plan in served)
    summaries = {name: namespace[name].summary() for name in names if hasattr(namespace.get(name), "summary")}
    return {name: summary for name, summary in summaries.items() if summary is not None}


def _results(returns: Returns, namespace: dict[str, Any]) -> tuple[results.Packed | None, dict[str, str]]:
    """The cell's names, pickled for the kernel (None in a rank that sends none); and {name: why} for
    those left out.

    Every rank looks at the names, sending or not: a sharded value among them is gathered whole by
    all the ranks it is sharded over, while their process group is still up.
    """
    present = {name: namespace[name] for name in returns.names if name in namespace}
    send = returns.sent_by(int(os.environ.get("RANK", "0")))
    whole, skipped = sharded.gather(present, send, returns.running)
    if not send:
        return None, {}
    present = {name: value for name, value in present.items() if name not in skipped}
    data, unpicklable = results.dumps(present, whole)
    skipped.update(unpicklable)
    skipped.update({name: results.NOT_BOUND for name in returns.names if name not in namespace})
    return data, skipped


def _failure(
    error: BaseException, shell: Any, task: RankTask, summary: str | None = None, report_early: Report | None = None
) -> tuple[int, Failed]:
    """How the cell failed. A rank a peer's loss broke says so at once, with a plain traceback, through
    ``report_early``: taas stops it (SIGKILL 3 s after SIGTERM) while IPython formats its traceback, which
    parses every file it passes through (0.4 s for torch's distributed_c10d.py alone; many seconds with the
    other ranks doing the same on a busy machine); where it was must reach the kernel all the same."""
    global _held_termination
    when = time.monotonic()  # before formatting: the earliest failure is the root cause
    if task.keep:
        # A session's interrupt that comes now is for a cell already over: what this rank says of it must not
        # be cut short (the ranks a failed peer released are interrupted a moment after it).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    peer_lost = _peer_lost(error)
    if not isinstance(error, KeyboardInterrupt) and not task.keep and _held_termination is None:
        # Until its failure is reported (see release_termination): a rank broken by another's failure too,
        # so that what it says reaches the kernel however soon taas stops the others.
        _held_termination = HeldTermination()
    flush_all()
    interrupted = isinstance(error, KeyboardInterrupt)
    # An interrupt taas sent is not shown; one the cell raised itself is a failure like any other.
    record = Failed(
        when,
        type(error).__name__,
        summary or str(error),
        interrupted=interrupted,
        hint=_hint(error, task),
        peer_lost=peer_lost,
        stack=frames_as_dump(error) if peer_lost else "",
    )
    if peer_lost and report_early is not None:
        report_early(dataclasses.replace(record, traceback=_plain_traceback(error)))
    if task.keep and (interrupted or peer_lost):
        # A session's rank taas interrupted, or one released as a peer left: nobody reads its traceback (the cell
        # shows where it was), and the kernel gives it 5 s to leave the cell, which IPython's formatting of the
        # collective it left (torch's distributed_c10d.py) can take on a busy machine.
        record = dataclasses.replace(record, traceback=_plain_traceback(error))
    else:
        record = dataclasses.replace(record, traceback=format_traceback(error, shell))
    return (EXIT_INTERRUPTED if interrupted else EXIT_FAILED), record


def _plain_traceback(error: BaseException) -> list[str]:
    """Python's own rendering, without this module's frame: quick, whatever the files it passes through."""
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None
    return traceback.format_exception(type(error), error, tb)


# What a rank raises when another process of the run went away: a consequence, not a failure of its own.
# gloo's transport and torch's store say the first two; NCCL the next two; a stand-in loader the last.
_PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "failed to recv, got 0 bytes",
    "remote process exited",
    "communicator was aborted",
)
_PEER_LOST_TYPES = ("DistBackendError", "DistNetworkError")


def _peer_lost(error: BaseException) -> bool:
    """The error says another process of the run is gone: taas stops this rank, as it stops the others, and
    the kernel reports it as broken by that process's failure rather than as a failure of its own."""
    return any(
        isinstance(e, ProducersGone)
        or type(e).__name__ in _PEER_LOST_TYPES
        or any(phrase in str(e).lower() for phrase in _PEER_LOST)
        for e in _chain(error)
    )


def release_termination() -> None:
    """A one-shot rank reported its failure: taas's SIGTERM, held meanwhile, may end it now."""
    global _held_termination
    held, _held_termination = _held_termination, None
    if held is not None:
        held.release()


_held_termination: HeldTermination | None = None


# What torch says when a CPU-only rank asks for CUDA (no driver, no device visible, a CPU-only build).
_NO_CUDA = (
    "found no nvidia driver",
    "no cuda gpus are available",
    "torch not compiled with cuda enabled",
    "no cuda-capable device is detected",
    "cuda driver initialization failed",
)


def _hint(error: BaseException, task: RankTask) -> str:
    """One line of advice for mistakes taas can recognize; empty otherwise."""
    if task.device == "cpu" and any(phrase in str(e).lower() for e in _chain(error) for phrase in _NO_CUDA):
        return (
            "this run is on CPU (--device cpu), so CUDA is not available in its ranks: "
            "taas.device() gives each rank its device on CPU and CUDA runs alike"
        )
    return ""


def _chain(error: BaseException) -> list[BaseException]:
    """The error and those it was raised from or during, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain and len(chain) < 10:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain
