"""The notebook's visual debugger (JupyterLab, VS Code) switched on in a kernel that runs taas cells.

The kernel is driven over the Jupyter Debug Protocol as JupyterLab drives it: ``debug_request``s on
the control channel, ``debug_event``s on iopub. With the debugger on, the kernel's debugpy patches
``os.fork`` and the start of programs; nothing taas starts may join that session (it would wait for
a client that never attaches), and every kind of cell runs at its usual speed, during and after.
"""

from __future__ import annotations

import time

import psutil
import pytest

from conftest import Kernel

pytestmark = pytest.mark.kernel

# What JupyterLab's debugger sends first (its arguments, as @jupyterlab/debugger's session sends them).
INITIALIZE = {"clientID": "jupyterlab", "clientName": "JupyterLab", "adapterID": "python", "pathFormat": "path",
              "linesStartAt1": True, "columnsStartAt1": True, "supportsVariableType": True,
              "supportsVariablePaging": True, "supportsRunInTerminalRequest": True, "locale": "en"}
SECONDS = 10.0  # a 2-rank cell takes well under a second here; one that joined the debugger waits for ever

LOADER = """import os, torch, taas
from torch.utils.data import DataLoader
loader = DataLoader(list(range(8)), batch_size=2)
taas.register(loader)
"""


class Debugged:
    """A kernel and its debugging session, as a front end holds them."""

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.seq = 0

    def request(self, command: str, arguments: dict | None = None, timeout: float = 30) -> dict:
        self.seq += 1
        client = self.kernel.client
        message = client.session.msg("debug_request", {"type": "request", "seq": self.seq, "command": command,
                                                       "arguments": arguments or {}})
        client.control_channel.send(message)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = client.get_control_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == message["header"]["msg_id"]:
                return reply["content"]
        raise TimeoutError(f"no reply to {command}")

    def switch_on(self) -> None:
        for command, arguments in (("initialize", INITIALIZE), ("attach", {}), ("configurationDone", {})):
            assert self.request(command, arguments)["success"], command

    def switch_off(self) -> None:
        assert self.request("disconnect", {"restart": False, "terminateDebuggee": False})["success"]

    def events(self, kind: str) -> list[dict]:
        return [event for event in self.kernel.debug_events if event.get("event") == kind]

    def stopped_event(self, timeout: float = 30) -> dict:
        """The next ``stopped`` event (the kernel sends it on iopub while a cell runs)."""
        client, deadline = self.kernel.client, time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = client.get_iopub_msg(timeout=timeout)
            if message["msg_type"] == "debug_event" and message["content"].get("event") == "stopped":
                return message["content"]
        raise TimeoutError("no stopped event")


@pytest.fixture(scope="module")
def debugged():
    kernel = Kernel()
    yield Debugged(kernel)
    kernel.shutdown()


def timed(kernel: Kernel, cell: str, **kwargs):
    result = kernel.execute(cell, timeout=60, **kwargs).ok()
    assert result.seconds < SECONDS, f"{result.seconds:.1f} s: {cell[:60]!r}"
    return result


def every_kind_of_cell(kernel: Kernel) -> None:
    """Fork, fork server, a session, data producers, --max-restarts, and a rank's own DataLoader workers."""
    for start in ("fork", "forkserver"):
        shown = timed(kernel, f"#pragma taas --gpus 2 --start {start}\nprint('hi')").each_rank()
        assert shown.count("] hi") == 2, shown
    timed(kernel, "#pragma taas --gpus 2 --keep --return none\nimport os\nmine = int(os.environ['RANK'])")
    try:
        assert timed(kernel, "#pragma taas\nprint('mine', mine)").each_rank().count("] mine") == 2
    finally:
        kernel.execute("%taas stop").ok()
    kernel.execute(LOADER).ok()
    taken = timed(kernel, "#pragma taas --gpus 2 --cpus 1\nprint('batches', len(list(loader)))").each_rank()
    assert taken.count("] batches 2") == 2, taken
    workers = timed(kernel, "#pragma taas --gpus 2\nfrom torch.utils.data import DataLoader\n"
                            "print('sum', sum(int(b.sum()) for b in DataLoader(list(range(6)), num_workers=1)))")
    assert workers.each_rank().count("] sum 15") == 2, workers.stdout
    restarted = kernel.execute("#pragma taas --gpus 2 --max-restarts 1\nimport os\n"
                               "assert os.environ['TORCHELASTIC_RESTART_COUNT'] == '1' or os.environ['RANK'] == '0'",
                               timeout=60).ok()
    assert "every rank starts again" in restarted.stderr and restarted.seconds < SECONDS


def test_every_kind_of_taas_cell_runs_with_the_debugger_on_and_after_it_is_off(debugged):
    kernel = debugged.kernel
    debugged.switch_on()
    server = kernel.fork_server()
    assert server is not None
    server.kill()  # the extension started it as it loaded: the next one starts with the debugger on
    psutil.wait_procs([server], timeout=10)  # a zombie until the kernel reaps it, which counts as gone
    started = kernel.execute("#pragma taas --gpus 2 --start forkserver\nprint('hi')", timeout=60).ok()
    assert started.each_rank().count("] hi") == 2, "a fork server started under the debugger serves cells"
    every_kind_of_cell(kernel)
    assert kernel.fork_server() is not None and kernel.fork_server().pid != server.pid
    assert not debugged.events("debugpyAttach"), "a process taas started joined the kernel's debugging session"
    debugged.switch_off()
    every_kind_of_cell(kernel)


def test_the_kernels_own_cells_stop_at_their_breakpoints_after_taas_cells_ran(debugged):
    debugged.switch_on()
    try:
        timed(debugged.kernel, "#pragma taas --gpus 2\nprint('hi')")
        code = "a = 1\nb = a + 1\nprint(b)\n"
        path = debugged.request("dumpCell", {"code": code})["body"]["sourcePath"]
        placed = debugged.request("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 2}],
                                                     "sourceModified": False})
        assert placed["body"]["breakpoints"][0]["verified"], placed
        debugged.request("configurationDone")
        message = debugged.kernel.client.execute(code)
        stopped = debugged.stopped_event()
        thread = stopped["body"]["threadId"]
        frames = debugged.request("stackTrace", {"threadId": thread})["body"]["stackFrames"]
        assert (frames[0]["source"]["path"], frames[0]["line"]) == (path, 2), frames[0]
        debugged.request("continue", {"threadId": thread})
        reply = debugged.kernel.client.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == message and reply["content"]["status"] == "ok"
        debugged.request("setBreakpoints", {"source": {"path": path}, "breakpoints": [], "sourceModified": False})
    finally:
        debugged.switch_off()
