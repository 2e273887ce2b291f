"""What the benchmarks share: a real Jupyter kernel driven as a notebook drives it, and the report's frame.

Every benchmark here measures cells the way a user runs them: in an ipykernel of its own
process, over jupyter_client, with the kernel's own busy/idle stamps as the clock. The kernel,
the processes it leaves behind, the machine the figures were taken on and the command line
are the same for every benchmark, so they live here once; what is measured stays in each script.

The scripts run as ``python benchmarks/<name>.py``: their folder is then first on ``sys.path``,
so they import this module as ``harness``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import queue
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parent.parent
KERNEL_LOG = Path(tempfile.gettempdir()) / "taas-bench-kernels.log"

# Every process a benchmark starts gets the same environment: CPU ranks, gloo on loopback.
BENCH_ENV = {"TAAS_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "GLOO_SOCKET_IFNAME": "lo"}

# The fork server's module, as this checkout and as releases before the layout by process named it.
FORK_SERVER_MODULES = ("taas_magic.launch.forkserver.server", "taas_magic.forkserver")


class BenchError(RuntimeError):
    """A cell or a process of the benchmark failed: the figures would mean nothing."""


class Hung(BenchError):
    """A cell or a process did not finish in its time: it is stuck, and so may be what it started."""


# -- a real kernel, as a notebook drives it ----------------------------------------------------
@dataclass
class Cell:
    kernel_seconds: float  # busy -> idle, stamped by the kernel
    client_seconds: float  # execute request -> idle seen here
    stdout: str
    stderr: str
    error: str | None


class Kernel:
    """An ipykernel in its own process, driven over jupyter_client like a notebook frontend."""

    def __init__(self, grace: float = 10.0, env: dict[str, str] | None = None) -> None:
        self.grace = grace  # seconds its processes get to end after a shutdown before they are killed
        self.hung = False  # a cell never finished: whatever the kernel started may be stuck too
        self.manager = KernelManager(kernel_name="python3")
        with open(KERNEL_LOG, "ab") as log:  # the kernels' own chatter, kept out of the report
            self.manager.start_kernel(env={**os.environ, **BENCH_ENV, **(env or {})}, stdout=log, stderr=log)
        self.pid: int = self.manager.provisioner.process.pid
        self.client = self.manager.client()
        try:
            self.client.start_channels()
            self.client.wait_for_ready(timeout=120)
        except BaseException:
            self.shutdown()
            raise

    def run(self, code: str, on_stream: Callable[[str], None] | None = None, timeout: float = 180) -> Cell:
        """Execute one cell; raise BenchError if it fails, since its figures would be meaningless."""
        cell = self.execute(code, on_stream, timeout)
        if cell.error is not None:
            raise BenchError(
                f"cell failed: {cell.error}\n--- cell ---\n{code}\n--- stderr ---\n{cell.stderr}"
                f"\n(the kernels' own output is in {KERNEL_LOG})"
            )
        return cell

    def execute(self, code: str, on_stream: Callable[[str], None] | None = None, timeout: float = 180) -> Cell:
        """Execute one cell and return what it did, failed or not; raise Hung if it outlasts ``timeout``.

        ``on_stream`` sees each piece of the cell's output as it arrives, while the cell still runs.
        """
        started = time.perf_counter()
        msg_id = self.client.execute(code, allow_stdin=False)
        stamps: dict[str, datetime.datetime] = {}
        streams: dict[str, list[str]] = {"stdout": [], "stderr": []}
        error = None
        while "idle" not in stamps:
            if time.perf_counter() - started > timeout:
                self.hung = True
                raise Hung(f"cell did not finish in {timeout:g} s:\n{code}")
            try:
                msg = self.client.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status":
                stamps[content["execution_state"]] = msg["header"]["date"]
            elif kind == "stream":
                streams[content["name"]].append(content["text"])
                if on_stream is not None:
                    on_stream(content["text"])
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
        client_seconds = time.perf_counter() - started
        while self.client.get_shell_msg(timeout=30)["parent_header"].get("msg_id") != msg_id:
            pass  # the execute_reply, so the next cell starts from a clean slate
        return Cell(
            (stamps["idle"] - stamps["busy"]).total_seconds(),
            client_seconds,
            "".join(streams["stdout"]),
            "".join(streams["stderr"]),
            error,
        )

    def check_module(self, name: str) -> None:
        """Raise BenchError unless the kernel imports ``name`` from the same file as this process.

        The kernel inherits this process's environment (``PYTHONPATH`` included): the figures are
        those of the checkout the benchmark runs from, not of another installed copy.
        """
        mine = importlib.import_module(name).__file__
        theirs = self.run(f"import {name} as _module\nprint(_module.__file__)\ndel _module").stdout.strip()
        if theirs != mine:
            raise BenchError(
                f"the kernel imports {name} from {theirs}, this benchmark from {mine}: "
                "set PYTHONPATH (or install) so both use the same sources"
            )

    def fork_server(self) -> psutil.Process | None:
        for child in psutil.Process(self.pid).children():
            if _is_fork_server(child):
                return child
        return None

    def run_processes(self) -> list[psutil.Process]:
        """What a cell started that is still alive: the kernel's descendants less the idle fork server."""
        found = []
        try:
            children = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return []
        for child in children:
            try:
                found += ([] if _is_fork_server(child) else [child]) + child.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
        return found

    def wait_fork_server_idle(self, timeout: float = 120) -> None:
        """Until the fork server has imported torch and stopped using CPU: it is waiting for work."""
        server = self.fork_server()
        if server is None:
            raise BenchError("no fork server: was %load_ext taas_magic run?")
        if not _wait_quiet(
            lambda: sum(server.cpu_times()[:2]),
            threshold=0.005,
            quiet=0.3,
            poll=0.05,
            timeout=timeout,
            ready=lambda: _maps_library(server.pid, "libtorch_cpu"),
        ):
            raise BenchError(f"the fork server was still busy after {timeout} s")

    def wait_until_quiet(self, timeout: float = 120) -> None:
        """Until the kernel and its fork server stop using CPU, so they do not compete with a measurement."""
        processes = [psutil.Process(self.pid)] + psutil.Process(self.pid).children()
        if not _wait_quiet(
            lambda: sum(sum(p.cpu_times()[:2]) for p in processes if p.is_running()),
            threshold=0.01,
            quiet=0.5,
            poll=0.1,
            timeout=timeout,
        ):
            raise BenchError(f"the kernel or its fork server was still busy after {timeout} s")

    def shutdown(self) -> list[str]:
        """Stop the kernel; return the command lines of its processes still alive ``grace`` s later (then killed)."""
        try:
            started = [psutil.Process(self.pid)] + psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            started = []
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)
        _, alive = psutil.wait_procs(started, timeout=self.grace)
        return kill(alive)


def kill(processes: list[psutil.Process]) -> list[str]:
    """Kill these processes (each by its own id); return their command lines."""
    left = []
    for process in processes:
        try:
            left.append(" ".join(process.cmdline())[:120])
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return left


def _is_fork_server(process: psutil.Process) -> bool:
    command = process.cmdline()
    return any(module in command for module in FORK_SERVER_MODULES)


def _wait_quiet(
    cpu_seconds: Callable[[], float],
    *,
    threshold: float,
    quiet: float,
    poll: float,
    timeout: float,
    ready: Callable[[], bool] = lambda: True,
) -> bool:
    """True once ``ready()`` and ``cpu_seconds()`` grew by at most ``threshold`` a poll for ``quiet`` seconds.

    CPU time, not wall time: a process that still imports or cleans up competes for the cores.
    """
    deadline = time.monotonic() + timeout
    last, quiet_since = -1.0, time.monotonic()
    while time.monotonic() < deadline:
        used = cpu_seconds()
        if used - last > threshold or not ready():
            last, quiet_since = used, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet:
            return True
        time.sleep(poll)
    return False


def _maps_library(pid: int, name: str) -> bool:
    try:
        return name in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


# -- the report's frame ------------------------------------------------------------------------
def arguments(doc: str, quick_help: str, results: Path, plot: Path, argv: list[str] | None) -> argparse.Namespace:
    """The command line every benchmark takes: a quick mode, and where its JSON and its plot go."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--results", type=Path, default=results, help="JSON output (default: %(default)s)")
    parser.add_argument("--plot", type=Path, default=plot, help="PNG output (default: %(default)s)")
    return parser.parse_args(argv)


class Progress:
    """Progress lines on stderr, stamped with the seconds since the benchmark started: stdout is the report."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, text: str) -> None:
        print(f"[{self.elapsed():5.0f} s] {text}", file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def plot_axes(width: float, height: float) -> tuple[Any, Any]:
    """A figure drawn off screen (no display here), and its one pair of axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def save_plot(figure: Any, path: Path) -> None:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def print_checks(found: list[tuple[bool, str]]) -> None:
    for ok, text in found:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")


def shown(path: Path) -> str:
    """A path as the report prints it: relative to the repository where it lies inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def machine_info(*packages: str) -> dict:
    """Where and with what the figures were taken; ``packages``: modules besides torch whose versions count."""
    import torch

    import taas_magic

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **{name: importlib.import_module(name).__version__ for name in packages},
        "taas_magic": taas_magic.__version__,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()
