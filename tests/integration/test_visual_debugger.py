"""The kernel's side of ranks in the notebook's visual debugger, without a kernel: JupyterLab's ``continue`` that
names thread 1, the engines' messages over their sockets, a rank that leaves before it answers, the link a cell's
ranks join by, and a cell's file named after the cell as typed. The routing alone is tested in
``tests/unit/kernel/test_debugger_router.py``."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time

import pytest

from taas_magic.kernel.debugging.debugger_router import RANK_IDS
from taas_magic.kernel.debugging.rank_engines import RankEngine, dap_messages
from taas_magic.kernel.debugging.visual_debugger import REATTACH_SECONDS, RankDebugging
from taas_magic.kernel.header import cell_source


class FakeDebugger:
    """What the hub reads of ipykernel's Debugger."""

    def __init__(self) -> None:
        self.is_started = True
        self.breakpoint_list: dict[str, list[dict]] = {}
        self.stopped_threads: set[int] = set()
        self.events: list[dict] = []

    def event_callback(self, event: dict) -> None:
        self.events.append(event)

    async def process_request(self, message: dict) -> dict:
        return {"type": "response", "request_seq": message["seq"], "success": True, "command": message["command"]}


def a_rank(number: int) -> RankEngine:
    """A rank's connection that nothing answers (a socket pair, one end kept by the test)."""
    ours, theirs = socket.socketpair()
    rank = RankEngine(ours, lambda rank, event: None, lambda rank: None)
    rank.name("run", number)
    rank.peer = theirs  # type: ignore[attr-defined]
    return rank


def test_jupyterlabs_continue_of_thread_1_goes_to_the_rank_it_shows():
    debugger = FakeDebugger()
    hub = RankDebugging(debugger)
    rank = a_rank(1)
    hub.focus.rank_event(rank, {"event": "stopped", "body": {"threadId": 1, "reason": "breakpoint"}})
    assert hub.focus.settle()
    shown = hub.focus.now.shown
    assert shown is not None and shown >= RANK_IDS and hub.stopped_ranks() == {1}
    assert [e["event"] for e in debugger.events] == ["stopped"] and debugger.events[0]["body"]["threadId"] == shown
    assert hub._continues_the_shown_rank({"threadId": 1})
    debugger.stopped_threads.add(1)
    assert not hub._continues_the_shown_rank({"threadId": 1}), "the kernel's own stopped thread 1 is the kernel's"
    debugger.stopped_threads.clear()
    hub.focus.rank_event(rank, {"event": "continued", "body": {"threadId": 1}})
    assert hub.focus.settle()
    assert hub.focus.now.shown is None and not hub._continues_the_shown_rank({"threadId": 1})
    assert hub.stopped_ranks() == frozenset()


def test_the_engines_messages_are_read_whole_across_partial_writes():
    ours, theirs = socket.socketpair()
    messages = [b'{"type": "event", "event": "stopped", "seq": 1}', b'{"type": "response", "request_seq": 7}']
    wire = b"".join(b"Content-Length: %d\r\n\r\n%s" % (len(m), m) for m in messages)

    def write() -> None:
        for start in range(0, len(wire), 7):
            theirs.sendall(wire[start : start + 7])
        theirs.close()

    writer = threading.Thread(target=write)
    writer.start()
    assert [m.get("seq", m.get("request_seq")) for m in dap_messages(ours)] == [1, 7]
    writer.join()


def test_a_rank_that_goes_away_fails_what_waits_for_its_answer():
    rank = a_rank(0)
    answer = rank.send("threads", {})
    rank.peer.close()  # type: ignore[attr-defined]
    try:
        answer.result(5)
    except ConnectionError as e:
        assert "rank 0" in str(e)
    else:
        raise AssertionError("no error")


@pytest.mark.parametrize("command", ["continue", "next", "stepIn", "stepOut", "stackTrace", "evaluate"])
def test_a_rank_that_ends_before_it_answers_went_on_if_told_to_and_failed_anything_else(command):
    """A rank told to go on may run to its end, and exit, before its answer leaves: it did go on. A question
    it could not answer failed, and says which rank left."""
    hub = RankDebugging(FakeDebugger())
    rank = a_rank(2)
    threading.Timer(0.2, rank.peer.close).start()  # type: ignore[attr-defined]  # the rank exits, unanswering
    reply = hub._for_rank(rank, {"command": command, "seq": 9, "arguments": {"threadId": 1, "frameId": 1}})
    assert (reply["command"], reply["request_seq"]) == (command, 9)
    if command in ("continue", "next", "stepIn", "stepOut"):
        assert reply["success"] is True, reply
    else:
        assert reply["success"] is False and reply["message"] == "rank 2: rank 2 left the debugger", reply


def a_joined_rank(hub: RankDebugging, run: str, number: int, thread: int) -> socket.socket:
    """A rank of ``run`` connected to ``hub`` as ``_welcome`` leaves it, its thread announced; the rank's end."""
    ours, theirs = socket.socketpair()
    rank = RankEngine(ours, hub.focus.rank_event, hub._gone)
    rank.name(run, number)
    with hub.lock:
        hub.ranks.append(rank)
    hub.focus.rank_event(rank, {"event": "thread", "body": {"reason": "started", "threadId": thread}})
    assert hub.focus.settle()
    return theirs


def exited(debugger: FakeDebugger) -> list[int]:
    threads = [e["body"] for e in debugger.events if e["event"] == "thread"]
    return [body["threadId"] for body in threads if body["reason"] == "exited"]


def test_a_cells_end_waits_until_the_front_end_was_told_its_ranks_threads_exited():
    """The sockets close as the ranks end, but the threads that read them may run later than the cell's end (a
    busy machine): the front end would be told the threads exited after the cell ended, or showed them still."""
    debugger = FakeDebugger()
    hub = RankDebugging(debugger)
    ends = [a_joined_rank(hub, "cell", number, 1) for number in (0, 1)]
    other = a_joined_rank(hub, "session", 0, 1)  # another run's rank stays
    threading.Timer(0.3, lambda: [end.close() for end in ends]).start()
    started = time.monotonic()
    hub.ranks_left("cell", timeout=10)
    assert time.monotonic() - started < 5
    assert len(exited(debugger)) == 2 and len(set(exited(debugger))) == 2
    assert [rank.run for rank in hub.ranks] == ["session"]
    started = time.monotonic()
    hub.ranks_left("session", timeout=0.3)  # a rank whose process lives on is not waited for beyond the timeout
    assert 0.25 < time.monotonic() - started < 3 and len(exited(debugger)) == 2
    other.close()


def test_a_taas_cells_header_lines_are_counted_when_the_history_holds_it():
    cell = "x = 1\n"  # what the magic gets: the header became its %%taas line
    assert cell_source._header_lines("#pragma taas --gpus 2\nx = 1\n", cell) == 1
    assert cell_source._header_lines("%%taas --gpus 2\nx = 1", cell) == 1
    assert cell_source._header_lines("#!g2.8\nx = 1", cell) == 1
    assert cell_source._header_lines("#pragma taas --gpus 2\ny = 2\n", cell) == 0, "another cell's text"
    assert cell_source._header_lines("print(1)", cell) == 0


def debug_link(capsys, spec_line: str, attached: bool, breakpoints: bool, on_cluster: bool = False):
    """What the runner gives a cell's ranks, and what it says on stderr."""
    import dataclasses
    from types import SimpleNamespace

    from taas_magic.configurations import load_catalog
    from taas_magic.kernel.header import options, spec
    from taas_magic.kernel.magics import TaasMagics
    from taas_magic.kernel.runner import CellRunner
    from taas_magic.process.machine import Machine

    debugger = FakeDebugger()
    debugger.is_started = attached
    if breakpoints:
        debugger.breakpoint_list = {"/tmp/ipykernel_1/2.py": [{"line": 3}]}
    hub = RankDebugging(debugger)
    built = spec.build(options.parse(TaasMagics.taas, spec_line), load_catalog(), Machine(cpus=8, cuda_devices=0), {})
    built = dataclasses.replace(built, on_cluster=on_cluster)
    try:
        link = CellRunner._debug_link(SimpleNamespace(debugging=hub), built, "/tmp/ipykernel_1/2.py")  # type: ignore[arg-type]
        return link, capsys.readouterr().err
    finally:
        hub.uninstall()


def test_a_cell_runs_with_the_link_its_ranks_join_by_while_a_client_is_attached(capsys):
    link, said = debug_link(capsys, "--gpus 4 --device cpu --debug-ranks 1,3", attached=True, breakpoints=True)
    assert link is not None and link.eager and link.ranks == frozenset({1, 3}) and not said
    assert link.takes_part(3) and not link.takes_part(0) and link.token(3).endswith(":3")
    link, said = debug_link(capsys, "--gpus 2 --device cpu", attached=True, breakpoints=False)
    assert link is not None and not link.eager and link.ranks is None, "no breakpoint: ranks join at breakpoint()"
    link, said = debug_link(capsys, "--gpus 2 --device cpu", attached=False, breakpoints=True)
    assert link is None and not said


def test_debug_ranks_without_the_debugger_and_breakpoints_on_a_cluster_are_said_in_one_line(capsys):
    link, said = debug_link(capsys, "--gpus 2 --device cpu --debug-ranks 1", attached=False, breakpoints=False)
    assert link is None
    assert said == "taas: --debug-ranks has no effect: the notebook's debugger is off (switch it on first)\n"
    link, said = debug_link(capsys, "--gpus 2 --device cpu", attached=True, breakpoints=True, on_cluster=True)
    assert link is None and said.startswith("taas: breakpoints do not stop cluster ranks") and said.count("\n") == 1
    link, said = debug_link(capsys, "--gpus 2 --device cpu", attached=True, breakpoints=False, on_cluster=True)
    assert link is None and not said, "no breakpoint set: nothing to say"


def test_a_rank_the_kernel_hangs_up_on_runs_on_without_the_debugger():
    """A rank connects while the client detaches (the kernel closes the connection before the
    breakpoints): it must not wait for ever in the debugger's engine."""
    import subprocess
    import sys
    import textwrap

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def hang_up() -> None:
        while True:  # the rank's checks that the port listens, then its engine, each time it tries
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connection.close()

    threading.Thread(target=hang_up, daemon=True).start()
    rank = textwrap.dedent(f"""
        import time
        from taas_magic.rank import visual_debugging
        from taas_magic.wire.task import DebugLink
        began = time.monotonic()
        joined = visual_debugging._join(DebugLink({port}, "secret", "run", eager=True), 0)
        print(joined, round(time.monotonic() - began))
    """)
    try:
        done = subprocess.run([sys.executable, "-c", rank], capture_output=True, text=True, timeout=60)
    finally:
        listener.close()
    assert done.stdout.split()[0] == "False", done.stdout + done.stderr
    assert int(done.stdout.split()[1]) < 10


class RecordingDebugger(FakeDebugger):
    """A debugger whose client attaches and detaches as a front end's does; it notes when each request arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived: list[tuple[str, float]] = []

    async def process_request(self, message: dict) -> dict:
        self.arrived.append((message["command"], time.monotonic()))
        if message["command"] == "initialize":
            self.is_started = True
        elif message["command"] == "disconnect":
            self.is_started = False
        return await super().process_request(message)


def test_a_client_that_attaches_again_at_once_reaches_the_debugger_only_once_debugpy_let_the_last_go():
    debugger = RecordingDebugger()
    hub = RankDebugging(debugger)
    hub.install()
    held = []  # how long each initialize waited in the hub
    try:
        for seq, command in enumerate(("disconnect", "initialize", "disconnect", "initialize"), start=1):
            if seq == 4:
                time.sleep(REATTACH_SECONDS)  # a person's pause: nothing more to wait
            started = time.monotonic()
            asyncio.run(hub.process_request({"seq": seq, "command": command, "arguments": {}}))
            if command == "initialize":
                held.append(debugger.arrived[-1][1] - started)
    finally:
        hub.uninstall()
    (_, first_off), (_, first_on), _, _ = debugger.arrived
    assert first_on - first_off >= REATTACH_SECONDS * 0.99, "the adapter was given time to end the session"
    assert held[1] < REATTACH_SECONDS / 2, f"a client that attaches later is held {held[1]:.2f} s"


def test_detaching_ends_the_thread_that_waits_for_ranks_to_join():
    hub = RankDebugging(FakeDebugger())
    hub.install()
    port = hub.link(None, "/tmp/ipykernel_1/2.py").port
    accepting = [t for t in threading.enumerate() if t.name == "taas-debugger-ranks"]
    assert len(accepting) == 1 and port > 0
    time.sleep(0.3)  # in accept() by now
    rank = os.fork()  # a forked rank holds the listener too, as every rank of a fork cell does
    if rank == 0:
        time.sleep(5)
        os._exit(0)
    try:
        hub.uninstall()  # as the client's disconnect does: the listener closes
        accepting[0].join(timeout=3)
        assert not accepting[0].is_alive(), "a thread left waiting in accept() for each session the client had"
    finally:
        os.kill(rank, signal.SIGKILL)
        os.waitpid(rank, 0)
