"""The first code in every rank: bind it to its place in the job, run the cell, report, exit.

Runs in a process forked from the kernel, so it first cuts every tie to the kernel's machinery
(ZeroMQ streams, display, input, signal handlers) and ties its life to the kernel's instead.
It never returns: the process ends with ``os._exit`` so the kernel's atexit handlers never run.
"""

from __future__ import annotations

import builtins
import ctypes
import faulthandler
import io
import json
import linecache
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from types import CodeType
from typing import Any

from . import results, storage

PR_SET_CHILD_SUBREAPER = 36
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up in the kernel, used in the child
except (AttributeError, OSError):
    _prctl = None


@dataclass(frozen=True)
class KernelContext:
    """The kernel's process state that spawned ranks must see as forked ones do."""

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]
    random_states: tuple[Any, Any, Any]  # torch's CPU generator, `random`, numpy (None if not imported)

    @classmethod
    def of_this_process(cls) -> "KernelContext":
        import random

        import torch

        numpy = sys.modules.get("numpy")
        states = (torch.get_rng_state(), random.getstate(), numpy.random.get_state() if numpy else None)
        return cls(dict(os.environ), os.getcwd(), list(sys.path), states)

    def apply(self) -> None:
        import random

        import torch

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        torch_state, random_state, numpy_state = self.random_states
        torch.set_rng_state(torch_state)  # the same shuffles and draws as ranks forked from the kernel
        random.setstate(random_state)
        if numpy_state is not None:
            import numpy

            numpy.random.set_state(numpy_state)


@dataclass(frozen=True)
class RankTask:
    """What every rank runs: the cell's compiled code, and how to bind the rank to its device."""

    code: CodeType
    device: str  # "cuda" or "cpu"
    threads: int  # intra-op threads on CPU
    return_names: tuple[str, ...] = ()  # what rank 0 sends back into the notebook
    namespace: dict[str, Any] | None = None  # spawned ranks: the shipped names; forked: the kernel's own
    source: str = ""  # the cell's code, for tracebacks where the kernel's line cache is not inherited
    cell_label: str = ""  # "Cell In[5]": how tracebacks name the cell
    loaders: tuple[Any, ...] = ()  # delivery plans of the registered loaders the cell uses
    context: KernelContext | None = None  # spawned ranks: the kernel's environment, folder and sys.path

    def run(self, env: dict[str, str], fds: "RankFds") -> int:
        return run_rank(self, env, fds)


@dataclass(frozen=True)
class RankFds:
    """The rank's ends of its channels to the kernel."""

    stdout: int
    stderr: int
    report: int
    stack: int
    results: int  # rank 0's pickled names, written once at the end
    lifeline: int  # read end of a pipe only the kernel writes: EOF means the kernel is gone


def run_rank(task: RankTask, env: dict[str, str], fds: RankFds) -> int:
    """Become a rank and run the cell; returns the exit status for ``os._exit``."""
    shell = become_child(fds, env)
    namespace = _namespace(task, shell)
    _bind_device(task, int(env["LOCAL_RANK"]), namespace)
    rank = int(env["RANK"])
    storage.guard_torch_save(rank, lambda record: report(fds.report, record), namespace)
    for plan in task.loaders:
        namespace[plan.name] = plan.stand_in(rank, namespace[plan.name], task.device)
    try:
        return _execute(task, namespace, shell if task.namespace is None else None, fds, send_results=rank == 0)
    finally:
        for plan in task.loaders:
            finish = getattr(namespace.get(plan.name), "finish", None)
            if finish is not None:
                finish()
        flush_all()
        end_descendants()


def become_child(fds: RankFds, env: dict[str, str]) -> Any:
    """What every process forked for a run does first; returns the kernel's shell object, if any."""
    _tie_life_to_kernel(fds.lifeline)
    _redirect_output(fds.stdout, fds.stderr)
    _reset_signals(fds.stack)
    os.environ.update(env)
    shell = _detach_from_kernel()
    _look_like_a_script()
    return shell


def _namespace(task: RankTask, shell: Any) -> dict[str, Any]:
    if task.namespace is not None:
        if task.source:
            linecache.cache[task.code.co_filename] = (len(task.source), None, task.source.splitlines(True),
                                                      task.code.co_filename)
        if _uses_name(task.code, "get_ipython"):
            _standalone_shell(task.namespace)
        return task.namespace
    return shell.user_ns if shell is not None else {"__name__": "__main__"}


def _uses_name(code: CodeType, name: str) -> bool:
    return name in code.co_names or any(
        isinstance(const, CodeType) and _uses_name(const, name) for const in code.co_consts)


def _standalone_shell(namespace: dict[str, Any]) -> None:
    """IPython syntax (magics, `!cmd`) in a spawned rank: a shell of its own over the rank's namespace."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False  # no history database for a rank
    shell = InteractiveShell.instance(config=config, user_ns=namespace)
    shell.display_pub.publish = _print_display_data


def _tie_life_to_kernel(lifeline: int) -> None:
    """Kill this rank's whole process group as soon as the kernel dies, even by kill -9.

    The lifeline thread, not PR_SET_PDEATHSIG, does it: a death signal would end the rank alone
    and leave its DataLoader workers running for seconds.
    """
    if _prctl is not None:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of our children stay ours to end

    def watch() -> None:
        try:
            while os.read(lifeline, 1):
                pass
        except OSError:
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="taas-lifeline", daemon=True).start()


def end_descendants() -> None:
    """Whatever the cell started and left running ends with the rank, even outside its process group."""
    try:
        import psutil

        descendants = psutil.Process().children(recursive=True)
    except Exception:
        return
    for process in descendants:
        try:
            process.kill()
        except Exception:
            pass


def _redirect_output(stdout_fd: int, stderr_fd: int) -> None:
    """Fds 1 and 2 become the rank's pipes, so C-level writes and child processes are caught too."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    old_streams = (sys.stdout, sys.stderr)
    for fd, target in ((stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = sys.__stdout__ = _text_stream(1)
    sys.stderr = sys.__stderr__ = _text_stream(2)
    sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)
    # Loggers and libraries may hold the kernel's stream objects (ZeroMQ-backed, unusable here):
    # make those objects write to the new streams.
    for old, new in zip(old_streams, (sys.stdout, sys.stderr)):
        for name in ("write", "writelines", "flush"):
            try:
                setattr(old, name, getattr(new, name))
            except (AttributeError, TypeError):
                pass


def _text_stream(fd: int) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", line_buffering=True, write_through=True)


def _reset_signals(stack_fd: int) -> None:
    """Interrupts become KeyboardInterrupt (so `finally` runs), SIGTERM ends the rank, SIGUSR1 dumps stacks."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    faulthandler.register(signal.SIGUSR1, file=stack_fd, all_threads=True, chain=False)


def _detach_from_kernel() -> Any:
    """Replace what talks to the kernel's frontend with plain-stream equivalents."""
    builtins.input = _no_input
    sys.displayhook = sys.__displayhook__
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    if shell is not None:
        shell.display_pub.publish = _print_display_data
        # Every message to the frontend (streams, displays, widget comms) goes through the kernel's
        # session; this process's copies of the kernel's ZeroMQ sockets must never be used.
        session = getattr(getattr(shell, "kernel", None), "session", None)
        if session is not None:
            session.send = _drop_message
    return shell


def _look_like_a_script() -> None:
    """A rank is a torchrun-style worker, not an interactive session: say so to libraries that ask.

    Lightning refuses `strategy="ddp"` (and would start processes of its own) when it believes it
    runs interactively; it decided that when the kernel imported it, so the copies of that
    decision in already-imported Lightning modules are corrected too.
    """
    for name in ("ps1", "ps2"):
        if hasattr(sys, name):
            delattr(sys, name)
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] in _LIGHTNING_PACKAGES and getattr(module, "_IS_INTERACTIVE", False):
            module._IS_INTERACTIVE = False


_LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")


def _no_input(prompt: object = "") -> str:
    raise RuntimeError("input() is not available inside a taas cell's ranks: read input in an earlier cell")


def _print_display_data(data: dict[str, Any], metadata: Any = None, **kwargs: Any) -> None:
    text = data.get("text/plain") if isinstance(data, dict) else None
    if text:
        print(text)


def _drop_message(*args: Any, **kwargs: Any) -> None:
    return None


def _bind_device(task: RankTask, local_rank: int, namespace: dict[str, Any]) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if task.device == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(task.threads)
        _serve_nccl_with_gloo(torch, namespace)


def _serve_nccl_with_gloo(torch: Any, namespace: dict[str, Any]) -> None:
    """On CPU a notebook written for GPUs runs unchanged: backend "nccl" is given to gloo."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.init_process_group
    noticed = []

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if str(backend).lower() == "nccl":
            if not noticed and os.environ.get("RANK") == "0":
                noticed.append(True)
                print("taas: --device cpu: backend 'nccl' is served by 'gloo'", file=sys.stderr)
            backend = "gloo"
        return original(backend, *args, **kwargs)

    dist.init_process_group = c10d.init_process_group = init_process_group
    for name, value in list(namespace.items()):
        if value is original:
            namespace[name] = init_process_group


def _execute(task: RankTask, namespace: dict[str, Any], shell: Any, fds: RankFds, send_results: bool) -> int:
    try:
        exec(task.code, namespace)
    except SystemExit as e:
        if e.code not in (None, 0):
            return _report_failure(fds.report, e, shell, task, f"the cell called sys.exit({e.code!r})")
    except BaseException as e:
        return _report_failure(fds.report, e, shell, task)
    skipped = _send_results(task.return_names, namespace, fds.results) if send_results else {}
    report(fds.report, {"status": "ok", "skipped": skipped, "delivery": _delivery_summaries(task, namespace)})
    return 0


def _delivery_summaries(task: RankTask, namespace: dict[str, Any]) -> dict[str, Any]:
    """How each stand-in loader fared in this rank: elements received, time spent waiting."""
    return {plan.name: namespace[plan.name].summary() for plan in task.loaders
            if hasattr(namespace.get(plan.name), "summary")}


def _send_results(names: tuple[str, ...], namespace: dict[str, Any], fd: int) -> dict[str, str]:
    """Pickle the cell's names into the results channel; returns {name: why} for those left out."""
    present = {name: namespace[name] for name in names if name in namespace}
    data, skipped = results.dumps(present) if present else (b"", {})
    skipped.update({name: "not bound when the cell ended" for name in names if name not in namespace})
    try:
        write_all(fd, data)
    finally:
        os.close(fd)
    return skipped


def _report_failure(report_fd: int, error: BaseException, shell: Any, task: RankTask, summary: str | None = None) -> int:
    when = time.monotonic()  # before formatting: the earliest failure is the root cause
    flush_all()
    interrupted = isinstance(error, KeyboardInterrupt)
    report(
        report_fd,
        {
            "status": "interrupted" if interrupted else "error",
            "time": when,
            "ename": type(error).__name__,
            "evalue": summary or str(error),
            "traceback": [] if interrupted else format_traceback(error, shell, task),
        },
    )
    return EXIT_INTERRUPTED if interrupted else EXIT_FAILED


def format_traceback(error: BaseException, shell: Any, task: RankTask | None = None) -> list[str]:
    """The traceback as IPython would show it in the kernel, without this module's frame."""
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None
    try:
        if shell is not None:
            return list(shell.InteractiveTB.structured_traceback(type(error), error, tb))
        lines = _standalone_formatter().structured_traceback(type(error), error, tb)
        if task is None or not task.cell_label:
            return list(lines)
        return [line.replace(task.code.co_filename, task.cell_label) for line in lines]
    except Exception:
        return traceback.format_exception(type(error), error, tb)


def _standalone_formatter() -> Any:
    from IPython.core.ultratb import AutoFormattedTB

    try:
        return AutoFormattedTB(mode="Context", theme_name="linux")
    except TypeError:  # IPython 8
        return AutoFormattedTB(mode="Context", color_scheme="Linux")


def report(fd: int, record: dict[str, Any]) -> None:
    write_all(fd, (json.dumps(record) + "\n").encode())


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def flush_all() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
