"""A real Jupyter kernel driven through jupyter_client, as a notebook drives it, and what the
end-to-end tests read from it: a cell's streams, displays and error, the kernel's values, the
processes it holds.
"""

from __future__ import annotations

import contextlib
import glob
import os
import queue
import re
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator

import psutil
import zmq
from jupyter_client.manager import KernelManager

ANSI = re.compile(r"\x1b\[[0-9;]*m")
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # hides every GPU from a kernel, whatever the machine has


@dataclass
class CellResult:
    streams: list[tuple[str, str, float]] = field(default_factory=list)  # (name, text, arrival time)
    error: dict | None = None
    displays: list[dict] = field(default_factory=list)
    display_messages: list[tuple[str, str | None]] = field(default_factory=list)  # (message type, display id)
    reply: dict = field(default_factory=dict)  # the execute_reply's content (status, payload)
    seconds: float = 0.0
    prompts: list[str] = field(default_factory=list)  # input requests' prompts, in order
    msg_id: str = ""  # of the execute request: what a run in the background addresses its later messages to

    def text(self, name: str = "stdout") -> str:
        return "".join(text for stream, text, _ in self.streams if stream == name)

    @property
    def stdout(self) -> str:
        return self.text("stdout")

    def each_rank(self, name: str = "stdout") -> str:
        """The stream with every collapsed line (``[ranks 0-2] x``) written out once per rank, as
        ``[rank 0] x``, ``[rank 1] x``…: for tests about what each rank printed."""
        return each_rank(self.text(name))

    @property
    def stderr(self) -> str:
        return self.text("stderr")

    @property
    def traceback(self) -> str:
        return ANSI.sub("", "\n".join(self.error["traceback"])) if self.error else ""

    def ok(self) -> "CellResult":
        assert self.error is None, f"cell failed: {self.error['ename']}: {self.error['evalue']}\n{self.traceback}"
        return self


def ranks_in(runs: str) -> set[int]:
    """The ranks of a label's runs: "0-2,4" -> {0, 1, 2, 4}."""
    ranks: set[int] = set()
    for run in filter(None, runs.replace(" ", "").split(",")):
        first, _, last = run.partition("-")
        ranks |= set(range(int(first), int(last or first) + 1))
    return ranks


ROW = re.compile(r"rank (\d+) +(starting|running|done|failed|stopped|paused)\b")


def view_rows(text: str) -> list[str]:
    """The rank rows of a live view or summary (its ``text/plain``): not its caption, nor the lines under
    the rows (where the time went, the rank the others waited for)."""
    return [line for line in text.splitlines() if ROW.match(line)]


def view_notes(text: str) -> list[str]:
    """The lines under a view's rows: ranks' shares of time (``ranks 0,2: all_reduce 83% · computing 17%``),
    the rank the others waited for."""
    return [line for line in text.splitlines() if NOTE.match(line)]


NOTE = re.compile(r"ranks? [\d,-]+: |the others waited for ")


def each_rank(text: str) -> str:
    lines = []
    for line in text.splitlines(keepends=True):
        found = re.match(r"\[ranks ([\d,-]+)\]( ?)", line)
        if not found:
            lines.append(line)
            continue
        for rank in sorted(ranks_in(found[1])):
            lines.append(f"[rank {rank}]{found[2]}{line[found.end() :]}")
    return "".join(lines)


class Kernel:
    """A real ipykernel in its own process, with the extension loaded."""

    def __init__(
        self,
        extra_env: dict[str, str | None] | None = None,
        imports: str = "import torch, torch.distributed, os, sys, time",
        warm_fork_server: bool = True,
    ):
        """``extra_env``: variables of the kernel's environment besides this process's; None leaves one out.
        ``warm_fork_server`` False: the fork server starts with the kernel's first forkserver cell, not as the
        extension loads (TaasMagics.warm_fork_server): a kernel that runs none spares its few seconds of CPU."""
        merged = {**os.environ, "TAAS_DEVICE": "cpu", **(extra_env or {})}
        env = {name: value for name, value in merged.items() if value is not None}
        lazy = [] if warm_fork_server else ["--TaasMagics.warm_fork_server=False"]
        self.stacks_path = _stacks_file()
        arguments = [*lazy, _dump_stacks_on(STACKS_SIGNAL, self.stacks_path)]
        for attempt in range(START_ATTEMPTS):
            self.manager = KernelManager(kernel_name="python3")
            self.manager.start_kernel(env=env, extra_arguments=arguments)
            self.client = self.manager.client()
            # A front end that reads all the kernel sends: ZMQ's publisher drops messages for a subscriber that
            # has 1000 unread, as a test process on a busy machine can have (50 MB of rank output is 1,672
            # messages), and a lost message (the cell's output, its "idle") would look like taas's fault.
            self.client.context.setsockopt(zmq.RCVHWM, 0)
            self.client.start_channels()
            try:
                self.client.wait_for_ready(timeout=60)
                break
            except RuntimeError:
                # jupyter_client picks the kernel's ports and frees them for the kernel to bind: another
                # process (another worker's kernel, a rank's store) can take one meanwhile, and the kernel
                # dies at once ("Address already in use"). Anything else is the test's to see.
                self.client.stop_channels()
                if self.manager.is_alive() or attempt == START_ATTEMPTS - 1:
                    raise
                self.manager.cleanup_resources()
        self.pid = self.manager.provisioner.process.pid
        self.debug_events: list[dict] = []  # every debug_event seen on iopub while a cell ran
        # The messages addressed to a cell that had ended when they came (a run in the background's output and view),
        # by the cell's msg_id: seen while later cells ran, or by ``drain``.
        self.later: dict[str, CellResult] = {}
        self.execute(f"%load_ext taas_magic\n{imports}").ok()

    def execute(
        self,
        code: str,
        timeout: float = 90,
        interrupt_after: float | tuple[float, ...] | None = None,
        answers: list[str] | None = None,
        think: float = 0.0,
        counted_from: str | None = None,
    ) -> CellResult:
        """Run ``code`` as a cell; ``interrupt_after``: when to interrupt it, in seconds after the cell
        began (several times: a tuple), or after its stdout first said ``counted_from``; ``answers``: lines
        typed, in order, when the cell asks for input (Jupyter's stdin requests, as a front end answers them;
        their prompts go to ``prompts``); ``think``: seconds a person takes to type each answer."""
        result = CellResult()
        started = time.monotonic()
        began = None  # when the kernel said it runs the cell: an interrupt before that is lost by any kernel
        msg_id = result.msg_id = self.client.execute(code, allow_stdin=answers is not None)
        pending = list(answers or [])
        asked: list[float] = []  # when the unanswered input request came
        interrupts = sorted(
            interrupt_after
            if isinstance(interrupt_after, tuple)
            else []
            if interrupt_after is None
            else [interrupt_after]
        )
        while True:
            if answers is not None:
                self._answer(result, pending, asked, think)
            due = began + interrupts[0] - time.monotonic() if interrupts and began is not None else 0.2
            try:
                # an interrupt is sent on time, not on the next message
                msg = self.client.get_iopub_msg(timeout=min(0.2, max(0.001, due)))
            except queue.Empty:
                msg = None
            now = time.monotonic()
            while interrupts and began is not None and now - began >= interrupts[0]:
                self.manager.interrupt_kernel()
                interrupts.pop(0)
            if now - started > timeout:
                raise self._stuck(msg_id, f"cell did not finish in {timeout} s: {code[:200]!r}", result, started)
            if msg is not None and msg["msg_type"] == "debug_event":
                self.debug_events.append(msg["content"])
            if msg is not None and msg["parent_header"].get("msg_id") not in (msg_id, None):
                self._record_later(msg, now - started)
            if msg is None or msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "execute_input" and counted_from is None:
                began = now
            if _record(msg, result, now - started):
                break
            if counted_from is not None and began is None and counted_from in result.stdout:
                began = now
        result.seconds = time.monotonic() - started
        reply = self.client.get_shell_msg(timeout=10)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.client.get_shell_msg(timeout=10)
        result.reply = reply["content"]
        return result

    def _record_later(self, msg: dict, at: float) -> None:
        if msg["msg_type"] != "status":
            _record(msg, self.later.setdefault(msg["parent_header"]["msg_id"], CellResult()), at)

    def drain(self, seconds: float) -> None:
        """Read what the kernel sends for ``seconds`` while no cell runs: ``later`` keeps what was addressed to
        a cell (a run in the background's output, its view's updates)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                msg = self.client.get_iopub_msg(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id"):
                self._record_later(msg, 0.0)

    def _stuck(self, msg_id: str, what: str, result: CellResult, started: float) -> TimeoutError:
        """A cell that did not finish: the error says where each of the kernel's threads was, and what the
        cell said when it was then interrupted (taas tells where each rank was), so that the module's next
        test does not wait behind it either."""
        if not self.manager.is_alive():
            return TimeoutError(f"{what}\n{self._death()}")
        stacks = self.stacks()
        self.manager.interrupt_kernel()
        before = len(result.streams)
        ended = False
        deadline = time.monotonic() + 30
        while not ended and time.monotonic() < deadline:
            try:
                msg = self.client.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                ended = _record(msg, result, time.monotonic() - started)
        said = [text for _, text, _ in result.streams]
        said.insert(before, "\n(interrupted here)\n")
        said.append(result.traceback if ended else "(the interrupted cell did not end within 30 s)")
        return TimeoutError(
            f"{what}\nwhere the kernel's threads were:\n{stacks}\nwhat the cell said:\n" + "".join(said)
        )

    def _death(self) -> str:
        """How the kernel ended, and the last lines that Ray's driver in it logged, if it had connected."""
        process = self.manager.provisioner.process if self.manager.provisioner else None
        code = process.poll() if process is not None else None
        said = f"the kernel died (exit status {code}: a negative one is the signal that ended it)"
        for log in glob.glob(
            os.path.join(tempfile.gettempdir(), "ray", "session_*", "logs", f"*driver*_{self.pid}.log")
        ):
            with open(log, errors="replace") as file:
                said += f"\nthe end of {log}:\n" + "".join(file.readlines()[-20:])
        return said

    def stacks(self, wait: float = 1.0) -> str:
        """Every thread's Python stack in the kernel now, as faulthandler writes it."""
        try:
            before = os.path.getsize(self.stacks_path)
            os.kill(self.pid, STACKS_SIGNAL)
        except OSError as e:
            return f"(none: {e})"
        time.sleep(wait)
        with open(self.stacks_path, errors="replace") as file:
            file.seek(before)
            return file.read() or "(none came)"

    def _answer(self, result: CellResult, pending: list[str], asked: list[float], think: float) -> None:
        if not asked:
            try:
                request = self.client.get_stdin_msg(timeout=0.01)
            except queue.Empty:
                return
            if request["msg_type"] != "input_request":
                return
            result.prompts.append(request["content"]["prompt"])
            asked.append(time.monotonic())
        if time.monotonic() - asked[0] >= think:
            asked.clear()
            self.client.input(pending.pop(0) if pending else "q")

    def complete(self, code: str, timeout: float = 60) -> list[str]:
        """What tab completion offers at the end of ``code``, as a front end asks for it. The kernel's first
        completion loads IPython's completer (jedi): seconds, more on a busy machine."""
        msg_id = self.client.complete(code, len(code))
        deadline = time.monotonic() + timeout
        while True:
            reply = self.client.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]["matches"]

    def value(self, expression: str):
        """Evaluate in the kernel (not in ranks) and return the printed repr's literal value."""
        import ast

        return ast.literal_eval(self.execute(f"print(repr({expression}))").ok().stdout.strip())

    def children(self) -> list[psutil.Process]:
        """The kernel's descendants, less the fork server the extension keeps and the cluster driver of its
        connection to a cluster (and nothing they started)."""
        try:
            children = psutil.Process(self.pid).children(recursive=False)
        except psutil.NoSuchProcess:
            return []
        found = []
        for child in children:
            try:
                if self.is_fork_server(child) or self.is_cluster_driver(child):
                    found += child.children(recursive=True)
                else:
                    found += [child] + child.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
        return found

    @staticmethod
    def is_fork_server(process: psutil.Process) -> bool:
        """Whether ``process`` is a fork server; a child that just ended (a zombie until reaped) is none."""
        try:
            return "taas_magic.launch.forkserver.server" in " ".join(process.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # ZombieProcess is a NoSuchProcess
            return False

    @staticmethod
    def is_cluster_driver(process: psutil.Process) -> bool:
        """Whether ``process`` is the driver of the kernel's connection to a cluster."""
        try:
            return "taas_magic.launch.cluster.driver" in " ".join(process.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def cluster_driver(self) -> psutil.Process | None:
        drivers = [c for c in psutil.Process(self.pid).children() if self.is_cluster_driver(c)]
        return drivers[0] if drivers else None

    def fork_server(self) -> psutil.Process | None:
        servers = [c for c in psutil.Process(self.pid).children() if self.is_fork_server(c)]
        return servers[0] if servers else None

    def shutdown(self) -> None:
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.stacks_path)


def _record(msg: dict, result: CellResult, at: float) -> bool:
    """One of a cell's iopub messages into ``result`` (``at``: seconds since the cell was sent); whether it
    says the cell has ended."""
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        result.streams.append((content["name"], content["text"], at))
    elif kind == "error":
        result.error = content
    elif kind in ("display_data", "update_display_data", "execute_result"):
        result.displays.append(content["data"])
        result.display_messages.append((kind, content.get("transient", {}).get("display_id")))
    return kind == "status" and content["execution_state"] == "idle"


START_ATTEMPTS = 3  # a kernel whose port was taken before it could bind it is started again, on new ports
STACKS_SIGNAL = signal.SIGUSR2  # the test kernels' own: taas uses SIGUSR1 in ranks, nothing in the kernel


def _stacks_file() -> str:
    handle, path = tempfile.mkstemp(prefix="kernel-stacks-", suffix=".txt")
    os.close(handle)
    return path


def _dump_stacks_on(signum: int, path: str) -> str:
    """A kernel option that has faulthandler write every thread's stack to ``path`` on ``signum``; it binds
    no name in the notebook (faulthandler keeps the file open)."""
    line = f"__import__('faulthandler').register({int(signum)}, file=open({path!r}, 'a'), all_threads=True)"
    return f"--IPKernelApp.exec_lines={line}"


def processes_of_run(run_id: str) -> list[psutil.Process]:
    """Every live process that carries the run's id in its environment: what the ranks started with exec
    (a forked rank's own environment changes are not visible in /proc; ranks are checked by process id)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("TAAS_RUN_ID") == run_id and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def port_is_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def working_in(kernel: Kernel, folder: object) -> Iterator[None]:
    """The kernel's working folder (the notebook's folder, where taas writes what it leaves) is ``folder``
    for the block, and what it was after."""
    kernel.execute(f"import os as _os\n_folder_before = _os.getcwd()\n_os.chdir({str(folder)!r})").ok()
    try:
        yield
    finally:
        kernel.execute("_os.chdir(_folder_before)").ok()


def still_running(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``processes`` still running after up to ``timeout`` seconds. A process that died but that
    nobody reaped yet is a zombie: dead. Orphans (a killed kernel's) go to the machine's first process,
    which in a container may reap them late (seen under load) or never."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return [process for process in alive if _running(process)]


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
