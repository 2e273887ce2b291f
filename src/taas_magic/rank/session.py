"""A session's rank: the cells it is sent, one after another, in the same process and namespace.

The rank's names, its process group and its models stay from cell to cell, as they would in a
kernel. Each cell ends with one message on the rank's control channel, ``CellEnd`` (how it ended,
rank 0's names; ``wire/rank_control.py``): the supervisor relays the rank's output before it, so a
cell's output never trails its end. Interrupts belong to one cell each: between cells the rank
ignores them, and as it takes a cell it says ``InCell``; the supervisor holds an interrupt for a
cell on its way until then, and drops one that comes after the rank's cell ended. So an early one
is never lost and a late one never lands in the next cell.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from typing import Any

from taas_magic.process import containment
from taas_magic.process.child import RankFds, flush_all
from taas_magic.process.tracebacks import register_sources
from taas_magic.rank import debugger, healing, names_out, pulling
from taas_magic.rank.cell import failed_outside_code, run_cell
from taas_magic.rank.group_links import GroupLinks
from taas_magic.rank.release import Release
from taas_magic.rank.reloading import RankReloads
from taas_magic.rank.stopping import StepStops
from taas_magic.wire import records, results, shipping
from taas_magic.wire.channel import ChannelBroken
from taas_magic.wire.rank_control import CellEnd, InCell, Line, RankEnd, SessionCell, rank_end, world_variables
from taas_magic.wire.records import CellEnded, Failed
from taas_magic.wire.task import CellOrder, LoaderPlan, RankTask


def open_control(fds: RankFds) -> RankEnd | None:
    if fds.control is None:
        return None
    return rank_end(socket.socket(fileno=fds.control), fds.control_secret, os.environ.get("TAAS_RUN_ID", ""))


def serve(task: RankTask, namespace: dict[str, Any], shell: Any, fds: RankFds, control: RankEnd) -> int:
    """Run the first cell, then every cell the kernel sends, until it closes the channel.

    A cell that raised keeps its error for ``%taas debug``; a cell that called ``sys.exit()``
    ends the rank (and so the session), as it would end a script. A rank that ``joins`` the session in place
    of one that died runs no first cell: its first is the one that heals it.
    """
    last_error: BaseException | None = None
    cell: SessionCell | None = None if task.joins else SessionCell(task.order)
    served = task.order.loaders  # every loader the session serves, those registered since it started too
    interrupted = False  # before the cell's code began
    reloads = RankReloads(namespace)
    steps, links = StepStops(), GroupLinks()
    steps.answer_pull = lambda asked: pulling.answer(asked, namespace, control)
    release = Release(links)
    steps.install()
    links.install()
    release.install()
    while True:
        if cell is None:
            pass  # a newcomer, before its first cell
        elif cell.regroup:
            send_end(control, _regroup(links, cell, namespace, shell, task), None)
        elif cell.order.code is None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the debugger's own quit ends it
            send_end(control, _debug(last_error, control), None)
        else:
            with steps.running(cell.number), release.armed():
                status, record, names, error = _run(cell.order, namespace, shell, task, served, interrupted)
            record = _leaving(record, steps, links)
            last_error = error if error is not None else last_error
            reloads.after_cell()
            send_end(control, record, names)
            if isinstance(record, CellEnded) and record.exited:
                return status
        received = _next_cell(control)
        if received is None:
            return 0
        cell, tensors_fd, ends = received
        if cell.world is not None:  # resized: the loaders' stand-ins below share among the new number of ranks
            os.environ.update(world_variables(cell.world, cell.nodes))  # a newcomer was started with them
        held = _take_interrupts(control)
        register_sources(cell.sources)
        reloads.before_cell(cell.reload)  # before the names: the notebook's came from the new code
        if cell.names:
            shipping.unpack_into(namespace, cell.names, tensors_fd, cell.tensors_size)
        if cell.order.loaders:
            _stand_in_for_new_loaders(task, cell.order.loaders, ends, namespace)
            served += cell.order.loaders
        interrupted = held.came


def _take_interrupts(control: RankEnd) -> containment.HeldInterrupts:
    """The cell's interrupts count from now: recorded while its names are unpacked, raised as its
    code starts. Saying so lets the supervisor send those it held for the cell."""
    held = containment.HeldInterrupts()
    try:
        control.send(InCell())
    except ChannelBroken:
        pass  # the session is over: the cell's end says so
    return held


def _run(
    order: CellOrder,
    namespace: dict[str, Any],
    shell: Any,
    task: RankTask,
    served: tuple[LoaderPlan, ...],
    interrupted: bool,
) -> tuple[int, Any, results.Packed | None, BaseException | None]:
    """The cell's code with interrupts on: they raise KeyboardInterrupt in it, as in a kernel.

    ``interrupted``: one came while the cell's names were unpacked; its code does not start.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if interrupted:
            raise KeyboardInterrupt
        return run_cell(order, namespace, shell, task, served)
    except KeyboardInterrupt as e:  # outside the cell's code: before it began
        return (*failed_outside_code(e, shell, task), None, e)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt that comes late is for the cell just ended


def _leaving(record: records.Record, steps: StepStops, links: GroupLinks) -> records.Record:
    """A cell that failed or was interrupted: its record says where this rank stopped among its optimizer steps;
    and unless the ranks stopped together before one step, the rank cuts its groups' connections, so that no
    peer waits for it in a collective (``group_links.py``), and says so."""
    if not isinstance(record, Failed):
        return record
    progress = steps.progress()
    if progress is not None:
        record = dataclasses.replace(record, steps=progress[0], inside_step=progress[1])
    if not (record.interrupted and steps.stopped_there) and links.cut():
        record = dataclasses.replace(record, left_group=True)
    return record


def _regroup(
    links: GroupLinks, cell: SessionCell, namespace: dict[str, Any], shell: Any, task: RankTask
) -> records.Record:
    """The kernel's word after a cell that a rank left its group in, or died in, or as the session is resized:
    connect the group anew with every peer, the newcomers joining it, and give them what the others hold alike."""
    try:
        links.regroup(cell.number, cell.newcomers)
        if cell.newcomers and links.grouped():
            healing.heal(namespace, cell.newcomers, joined=cell.world is not None)
        elif int(os.environ["RANK"]) in cell.newcomers:
            healing.say_ungrouped(joined=cell.world is not None)
    except Exception as e:
        return failed_outside_code(e, shell, task)[1]
    return CellEnded(time.monotonic())


def send_end(control: RankEnd, record: records.Record, names: results.Packed | None) -> None:
    """The cell's end, with its names: small ones in the message, larger ones in a sealed memory file that
    the supervisor hands on to the kernel as it is (``events.ResultInFile``), and the kernel maps."""
    flush_all()
    names_out.send(control, lambda inline, in_file: CellEnd(records.encode(record), inline, in_file), names)


def _next_cell(control: RankEnd) -> tuple[SessionCell, int | None, list[int]] | None:
    """The next cell, its tensors' memory file, and the ends of the loaders it begins to serve (two
    each, last); None when the session is over."""
    try:
        cell, fds = control.receive()
        while isinstance(cell, Line):  # the answer to a prompt that an interrupt left meanwhile: nobody asks now
            cell, fds = control.receive()
    except ChannelBroken:
        return None
    ends = len(fds) - 2 * len(cell.order.loaders)
    return cell, (fds[0] if ends else None), fds[ends:]


def _stand_in_for_new_loaders(
    task: RankTask, plans: tuple[LoaderPlan, ...], ends: list[int], namespace: dict[str, Any]
) -> None:
    """Loaders registered since the session started: their names become stand-ins from this cell on."""
    from taas_magic.delivery.service import late_stand_ins

    on_a_node = "TAAS_NODE_ADDRESS" in os.environ  # a cluster's: the kernel makes the progress line of every node's
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    late_stand_ins(plans, ends, namespace, rank, world, task.device, reports=not on_a_node)


def _debug(error: BaseException | None, control: RankEnd) -> records.Record:
    """``%taas debug``: the post-mortem debugger at the last cell's error; the session goes on after it."""
    if error is None:
        print("taas: no cell failed in this rank: nothing to debug")
    else:
        debugger.post_mortem(error, control)
    return CellEnded(0.0)


def await_debugger(error: BaseException, control: RankEnd) -> None:
    """``--debug`` in a one-shot cell: this rank raised; it stays, paused, until ``%taas debug``
    opens the debugger at its error, or the kernel lets it go."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    flush_all()
    received = _next_cell(control)
    if received is None:
        return
    send_end(control, _debug(error, control), None)
    _next_cell(control)  # until the kernel closes the run
