"""Every message of a run, worded from its ``RunResult``: pure functions, no I/O.

What the cell shows when a run fails, times out, is interrupted or ends its session (``error``,
``session_ended``); the notices said after a cell; the lines about restarts. One-shot and session
cells share these functions; where their words differ, the result's ``Policy`` says how.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Mapping, TypeVar

from taas_magic.errors import RankFailed, RunInterrupted, RunTimedOut, SessionEnded, plain
from taas_magic.kernel.diagnosis.hang import Hang, Process, cause, doing, where_lines
from taas_magic.kernel.diagnosis.stacks import reporting_failure
from taas_magic.kernel.run.run_result import EndCause, Failure, Notice, Outcome, RunResult, quit_debugger
from taas_magic.per_rank import span
from taas_magic.wire.events import NODE_LOST, Key, key_order
from taas_magic.wire.records import CellEnded, DeliverySummary, Failed

RED, BOLD, RESET = "\x1b[0;31m", "\x1b[1m", "\x1b[0m"
Value = TypeVar("Value")


def error(result: RunResult, cell_names: Mapping[str, str]) -> BaseException | None:
    """What the cell raises for ``result`` (None: it succeeded); ``cell_names`` names the notebook's
    code files in stacks ("Cell In[5]")."""
    if result.outcome is Outcome.DONE:
        return None
    if result.outcome is Outcome.FAILED:
        message, lines = failure(result, result.policy.others_were, cell_names)
        if result.policy.keep:
            lines += steps_taken(result)
            lines.append(_goes_on(result))
        broken = sorted((f.rank, summary(f)) for f in result.broken if isinstance(f.rank, int))
        return RankFailed(message, lines, dict(broken))
    if result.outcome is Outcome.TIMED_OUT:
        return RunTimedOut(*timed_out(result, cell_names))
    if result.outcome is Outcome.INTERRUPTED:
        return RunInterrupted(
            interrupted(result) + _where(result, cell_names, "where the ranks were when interrupted:")
        )
    return session_ended(result, cell_names)


def _goes_on(result: RunResult) -> str:
    """What a session whose cell failed does next, in a line: every rank that died is named, whether it died first
    or after another rank failed, since a new process takes the place of each."""
    root = result.failures[0]
    exited = {rank: code for rank, code in result.exits.items() if isinstance(rank, int)}
    lost = [rank for rank, code in exited.items() if code == NODE_LOST]
    died = [rank for rank, code in exited.items() if code != NODE_LOST]
    line = "taas: the session goes on"
    if lost:
        line += f" without {span(lost)}, lost with their node"
    if died:
        line += f"{';' if lost else ','} a new process in place of {span(died)}"
    if root.raised is not None:
        line += f" (%taas debug opens the debugger in {name(result, root.rank)} at the error)"
    return line


def failure(result: RunResult, others_were: str, cell_names: Mapping[str, str] | None = None) -> tuple[str, list[str]]:
    """The root cause, in one line and in full; what else failed after it, and what taas did to the others."""
    failures = result.failures
    root = failures[0]
    who = name(result, root.rank)
    message = f"{who} failed{' ' + root.where if root.where else ''}: {summary(root)}"
    lines = [f"{RED}{BOLD}taas: {message}{RESET}"]
    ended = _ended_before(result, root.time)
    if ended:
        lines.append(f"{BOLD}before {who} failed: {ended}{RESET}")
    alike = [f.rank for f in failures if _same_error(f, root)]  # read once, labelled with every rank it is of
    if root.details:
        if len(alike) > 1:
            lines.append(
                f"{BOLD}[{names(result, alike)}] "
                + (
                    f"traceback ({who} failed first):"
                    if _is_traceback(root)
                    else f"last lines each wrote to stderr ({who}'s):"
                )
                + RESET
            )
        else:
            lines.append(
                f"{BOLD}{who}'s traceback:{RESET}"
                if _is_traceback(root)
                else f"{BOLD}last lines {who} wrote to stderr:{RESET}"
            )
        lines += root.details
    if root.hint:
        lines.append(f"{BOLD}taas: {root.hint}{RESET}")
    others = _alike_failures(result, [f for f in failures[1:] if f.rank not in alike])
    if len(alike) > 1 and not root.details:
        others.insert(0, f"{names(result, alike[1:])} ({summary(root)})")
    broken = {f.rank for f in result.broken}
    stopped = sorted((result.stopped | broken) - {f.rank for f in failures}, key=key_order)
    if others:
        lines.append(f"also failed, after {who}: " + "; ".join(others))
    released = sorted(broken, key=key_order) if result.policy.keep else []  # rank/group_links.py
    if released:
        lines.append(f"released from their collectives as {who} left them: {names(result, released)}")
    interrupted = [key for key in stopped if key not in released]
    if interrupted:
        lines.append(f"{others_were} after the failure: {names(result, interrupted)}")
    if stopped:
        peers = _peers_waiting(result)
        if peers:
            lines += [f"{BOLD}where they were when {who} failed:{RESET}"] + where_lines(
                peers, cell_names or {}, result.ranks_per_node
            )
    return plain(message), lines


def _peers_waiting(result: RunResult) -> list[Process]:
    """Where the ranks stopped after the first failure were, when some of them waited for it (else none):
    where each waited says for what, and ``failure`` shows it."""
    failures = result.failures
    who = name(result, failures[0].rank)
    broken = {f.rank for f in result.broken}
    stopped = (result.stopped | broken) - {f.rank for f in failures}
    peers = [
        _peer_place(p, who, result.records.get(p.key)) if p.key in broken or _reporting(p) else p
        for p in result.where
        if p.key in stopped
    ]
    return peers if any(_stuck(p) for p in peers) else []


def _same_error(one: Failure, other: Failure) -> bool:
    """The same failure in two processes: the same error, raised at the same lines (or the same death)."""
    return (one.raised, one.code, one.details, one.where, one.hint) == (
        other.raised,
        other.code,
        other.details,
        other.where,
        other.hint,
    )


def _alike_failures(result: RunResult, failures: list[Failure]) -> list[str]:
    """Each distinct failure once, with every process it happened in: "ranks 2,5 (KeyError: 'x')"."""
    groups: dict[str, list[Key]] = {}
    for failure_ in failures:
        groups.setdefault(summary(failure_), []).append(failure_.rank)
    return [f"{names(result, keys)} ({text})" for text, keys in groups.items()]


def _stuck(process: Process) -> bool:
    """In a collective, waiting for data or in process-group setup: waiting for others, maybe forever
    (as its last sample says, or its stack, which a rank in its first second has alone)."""
    activity = process.activity
    return (
        process.collective() is not None
        or process.in_setup()
        or bool(activity and activity.waiting)
        or (not _reporting(process) and bool(process.in_collective_call()))
    )


def _reporting(process: Process) -> bool:
    """Its stack shows it reporting a failure of its own: where it waited is gone."""
    return reporting_failure(process.stack)


def _peer_place(process: Process, failed: str, record: CellEnded | Failed | None) -> Process:
    """A peer whose collective broke as the failed rank exited: where its error came (the frames its record
    carries), else where its last sample saw it, until then. A stack taken while it was reporting that error
    shows taas formatting it, which says nothing of where it waited."""
    if isinstance(record, Failed) and record.stack:
        return dataclasses.replace(process, stack=record.stack, ended="")
    if process.stack and not _reporting(process):
        return process
    sampled = dataclasses.replace(process, stack="", ended="")
    activity = sampled.activity
    if sampled.collective() is None and not (activity and (activity.waiting or activity.setup is not None)):
        return dataclasses.replace(sampled, ended=f"its collective broke as {failed} exited")
    return dataclasses.replace(sampled, ended=f"{doing(sampled)}, until {failed} exited")


def timed_out(result: RunResult, cell_names: Mapping[str, str]) -> tuple[str, list[str]]:
    """``--timeout`` elapsed: which processes were still at work, and where each was."""
    stacks = result.late or {}
    late = sorted(stacks, key=key_order)
    message = (
        f"--timeout {result.timeout:g} s elapsed: {names(result, late)} still running, {result.policy.timeout_end}"
    )
    lines = [f"{RED}{BOLD}taas: {message}{RESET}", *steps_taken(result)]
    ended = _ended_before(result, float("inf"))
    if ended:
        lines.append(f"{BOLD}before the time ran out: {ended}{RESET}")
    lines += _where(result, cell_names, "where the processes were when the time ran out:")
    return message, lines


def interrupted(result: RunResult) -> list[str]:
    """The cell was interrupted: how each rank stopped (one-shot), or what taas interrupted (a session)."""
    if result.policy.keep:
        quit = f"the debugger was quit in {names(result, sorted(result.quit, key=key_order))}; " if result.quit else ""
        stopped = (
            f"taas interrupted the cell in {names(result, sorted(result.stopped, key=key_order))}; "
            if result.stopped
            else ""
        )
        return [f"{RED}{BOLD}KeyboardInterrupt{RESET}: {quit}{stopped}the session goes on", *steps_taken(result)]
    stops: dict[str, list[int]] = {}
    for rank, code in _in_order(result.exits):
        if isinstance(rank, int):
            stops.setdefault(_describe_stop(code, result.records.get(rank)), []).append(rank)
    how = "; ".join(f"{span(ranks)}: {what}" for what, ranks in stops.items())
    return [f"{RED}{BOLD}KeyboardInterrupt{RESET}: taas run interrupted; every rank stopped ({how})"]


def steps_taken(result: RunResult) -> list[str]:
    """Where a session's ranks that left the cell early stopped among their optimizer steps (interrupted at one step
    together, ``rank/stopping.py``; or failed, and released from their collectives, ``rank/group_links.py``): at the
    same one, DDP's replicas alike; or not, and what to do. Nothing when no rank had begun a step."""
    left: dict[Key, Failed] = {
        rank: record for rank, record in result.records.items() if isinstance(rank, int) and isinstance(record, Failed)
    }
    if all(record.steps is None for record in left.values()):
        return []
    places: dict[str, list[Key]] = {}
    for rank, record in _in_order(left):
        places.setdefault(_step_place(record), []).append(rank)
    if len(places) == 1 and not any(record.inside_step for record in left.values()):
        place, ranks = next(iter(places.items()))
        return [f"taas: {names(result, ranks)} stopped {place}, each with the same steps applied"]
    where = "; ".join(f"{names(result, ranks)} {place}" for place, ranks in places.items())
    return [
        f"{RED}taas: the ranks stopped at different points of their training ({where}): their models may differ "
        f"now; broadcast rank 0's parameters and optimizer state to the others, or start the session again{RESET}"
    ]


def _step_place(record: Failed) -> str:
    if record.steps is None:
        return "before their first optimizer step"
    if record.inside_step:
        return f"inside optimizer step {record.steps + 1}"
    return f"after optimizer step {record.steps} of this cell"


def session_ended(result: RunResult, cell_names: Mapping[str, str]) -> SessionEnded:
    """The session cannot go on: why, what became of the cell, and the ranks whose cell had failed."""
    ended = _session_ended(result, cell_names)
    ended.failed = tuple(failure.rank for failure in result.failures if isinstance(failure.rank, int))
    return ended


def _session_ended(result: RunResult, cell_names: Mapping[str, str]) -> SessionEnded:
    end = result.end
    if end is None or end.cause is EndCause.INTERRUPTED_TWICE:
        why = "interrupted twice while its ranks were leaving the cell"
        return SessionEnded(*_ended(why), why=why)
    if end.cause is EndCause.RANK_EXITED:
        rank = end.keys[0]
        record = result.records.get(rank)
        if isinstance(record, CellEnded) and record.exited:
            why = f"rank {rank} ended the session with {record.exited}"
        else:
            why = f"rank {rank} {describe_exit(end.code) if end.code else 'exited'}"
        why = f"{why}: its process group cannot continue"
        return SessionEnded(*_ended(why, list(end.tail)), why=why)
    if end.cause is EndCause.PRODUCER_DIED:
        message, lines = failure(result, result.policy.others_were)
        why = f"{name(result, end.keys[0])} cannot serve its loader any more"
        return SessionEnded(
            f"{message}; the session ended", lines + [f"{RED}{BOLD}taas: the session ended: {why}{RESET}"], why=why
        )
    stuck = list(end.keys)
    why = (
        f"{names(result, stuck)} did not leave the interrupted cell within "
        f"{result.policy.leave_seconds:g} s (a collective waits for its peers there, or the code "
        "ignores interrupts)"
    )
    message, lines = _ended(why)
    if result.failures:  # why they were interrupted: the failure comes first, with where the others waited for it
        failed, failed_lines = failure(result, "stopped", cell_names)  # the session ends: every rank is stopped
        where = [] if _peers_waiting(result) else _where(result, cell_names, "where they were:")  # shown with it
        return SessionEnded(f"{failed}; {message}", failed_lines + lines + where, why=why)
    lines += _where(result, cell_names, "where they were:")
    if result.late is not None:  # taas interrupted the cell because the time ran out: that first
        late = sorted(result.late, key=key_order)
        timeout = f"--timeout {result.timeout:g} s elapsed: {names(result, late)} still running, interrupted by taas"
        return SessionEnded(f"{timeout}; {message}", [f"{RED}{BOLD}taas: {timeout}{RESET}"] + lines, why=why)
    return SessionEnded(message, lines, why=why)


def hang(found: Hang, cell_names: Mapping[str, str]) -> list[str]:
    """The watchdog's diagnosis: how long nothing moved, the likely cause, and where each process is."""
    first = f"taas: no progress for {found.stalled:.0f} s: {cause(found.processes, cell_names)}"
    return (
        [f"{RED}{BOLD}{first}{RESET}"]
        + where_lines(found.processes, cell_names, found.ranks_per_node)
        + [
            f"{BOLD}taas: the run goes on: wait, or interrupt the cell to stop it (said after --hang-after "
            f"{found.after:g} s without progress; --hang-after 0 turns this off){RESET}"
        ]
    )


def _where(
    result: RunResult, cell_names: Mapping[str, str], title: str, only: frozenset[Key] | None = None
) -> list[str]:
    """Where the processes were when taas took their stacks, each place once (nothing if it took none)."""
    processes = [p for p in result.where if only is None or p.key in only]
    if not any(p.stack for p in processes):
        return []
    return [f"{BOLD}{title}{RESET}"] + where_lines(processes, cell_names, result.ranks_per_node)


def session_over(why: str) -> SessionEnded:
    """A cell sent to a session that ended before it."""
    return SessionEnded(f"the session ended: {why}", [f"taas: the session ended: {why}"], why=why)


def exited_between_cells(who: str, code: int) -> str:
    return f"{who} {exit_status(code) if code else 'exited'} between cells"


def _ended(why: str, details: list[str] | None = None) -> tuple[str, list[str]]:
    message = f"taas: the session ended: {why}"
    lines = [f"{RED}{BOLD}{message}{RESET}"] + (["last lines it wrote to stderr:"] + details if details else [])
    return plain(message), lines


# -- after the cell -----------------------------------------------------------------------------
def notices(result: RunResult) -> list[str]:
    """One line per cell for each kind of thing taas did on the user's behalf (those the policy says)."""
    lines = []
    for notice in result.policy.notices:
        if notice is Notice.SAVED_ON_NODE:
            lines += [
                f"taas: rank 0 saved {record.path} on node {record.node}: a file saved under an absolute path "
                "stays on its node (save under a relative path to have it copied here)"
                for record in result.saved_on_nodes
            ]
        elif notice is Notice.SAVE_SKIPPED and result.saves_skipped:
            paths = ", ".join(repr(path) for path in sorted(result.saves_skipped))
            ranks = sorted(key for keys in result.saves_skipped.values() for key in keys if isinstance(key, int))
            lines.append(
                f"taas: torch.save to {paths} skipped in {span(ranks)}: only rank 0 writes files "
                "(guard other writes with taas.is_main())"
            )
        elif notice is Notice.DELIVERY:
            lines += _delivery_summaries(result)
    return lines


def _delivery_summaries(result: RunResult) -> list[str]:
    per_loader: dict[str, list[DeliverySummary]] = {}
    for _, record in _in_order(result.records):
        for loader, summary_ in (record.delivery if isinstance(record, CellEnded) else {}).items():
            per_loader.setdefault(loader, []).append(summary_)
    lines = []
    for loader, summaries in sorted(per_loader.items()):
        taken = sum(s.taken for s in summaries)
        span = max((s.span for s in summaries), default=0.0)
        waited = sum(s.waited for s in summaries) / len(summaries)
        share = waited / span if span > 0 else 0.0
        first = max(s.first_wait for s in summaries)
        rate = f"{taken / span:,.0f} elements/s" if span > 0 else "—"
        ranks = f"{len(summaries)} rank{'s' if len(summaries) != 1 else ''}"
        lines.append(
            f"taas: {loader}: {taken} elements delivered to {ranks}, {rate}, "
            f"ranks waited for data {share:.0%} of the time (first element after {first * 1000:.0f} ms)"
        )
    return lines


def restarting(result: RunResult, restart: int, max_restarts: int) -> str:
    return (
        f"taas: {failure(result, result.policy.others_were)[0]}: every rank starts again (restart {restart} of "
        f"--max-restarts {max_restarts})\n"
    )


def restarts_spent(max_restarts: int) -> str:
    return f"taas: --max-restarts {max_restarts} spent: the cell fails with the last failure\n"


# -- pieces ---------------------------------------------------------------------------------------
def summary(failure_: Failure) -> str:
    """One line: "ValueError: boom" or "killed by signal SIGSEGV"."""
    if failure_.raised is None:
        return describe_exit(failure_.code)
    return f"{failure_.raised[0]}: {failure_.raised[1]}".rstrip(": ")


def describe_exit(code: int) -> str:
    """How a process left during a cell."""
    return exit_status(code) if code < 0 or code == NODE_LOST else f"{exit_status(code)} before the cell finished"


def exit_status(code: int) -> str:
    """How a process left, whenever it did: "killed by signal SIGKILL", "exited with code 3"."""
    if code == NODE_LOST:
        return "lost with its node"
    if code < 0:
        try:
            signame = signal.Signals(-code).name
        except ValueError:
            signame = f"signal {-code}"
        return f"killed by signal {signame}"
    return f"exited with code {code}"


def name(result: RunResult, key: Key) -> str:
    return result.labels.get(key, f"rank {key}")


def names(result: RunResult, keys: list[Key]) -> str:
    """ "ranks 0-2,4; producer 0 of train_loader"."""
    ranks = sorted(key for key in keys if isinstance(key, int))
    others = [name(result, key) for key in sorted(keys, key=key_order) if not isinstance(key, int)]
    return "; ".join(([span(ranks)] if ranks else []) + others)


def _ended_before(result: RunResult, moment: float) -> str:
    """Ranks whose cell ended without error before ``moment``: often why the others failed or hung.

    A rank that called sys.exit(0) ended as if it succeeded, but left its peers' collectives; so did
    one that left without a word (``os._exit(0)``): it exited with status 0 while its cell ran. Such
    a rank is no failure, and nothing else names it; taas did not stop it (it left before taas knew
    of a failure or a timeout). That order, not the clock, puts it before the failure: taas sees an
    exit a moment after it happened, and the peer it broke may have timed its own failure earlier.
    """
    ranks_by_end: dict[str, list[int]] = {}
    for rank, record in _in_order(result.records):
        if isinstance(rank, int) and isinstance(record, CellEnded) and record.time < moment:
            how = f"exited early with {record.exited}" if record.exited else "had finished the cell"
            ranks_by_end.setdefault(how, []).append(rank)
    for rank, code in _in_order(result.exits):
        if isinstance(rank, int) and code == 0 and rank not in result.records and rank not in result.stopped:
            ranks_by_end.setdefault(describe_exit(code), []).append(rank)
    return "; ".join(f"{span(ranks)} {how}" for how, ranks in ranks_by_end.items())


def _is_traceback(failure_: Failure) -> bool:
    return not summary(failure_).startswith(("killed by", "exited with"))


def _describe_stop(code: int, record: CellEnded | Failed | None) -> str:
    if record is not None and quit_debugger(record):
        return "quit the debugger"
    if isinstance(record, Failed) and record.interrupted:
        return "KeyboardInterrupt"
    if isinstance(record, CellEnded):
        return f"had exited with {record.exited}" if record.exited else "had finished"
    return describe_exit(code) if code else "exited"


def _in_order(by_key: Mapping[Key, Value]) -> list[tuple[Key, Value]]:
    """The items of ``by_key``: ranks first, by number, then producers."""
    return sorted(by_key.items(), key=lambda item: key_order(item[0]))
