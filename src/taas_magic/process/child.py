"""The first code in every process taas forks for a run — a rank or a data producer.

It cuts every tie to the kernel's machinery (ZeroMQ streams and sockets, display, input,
signal handlers), ties its life to its supervisor's instead, and sends what the kernel must
know over plain pipes. The process then ends with ``os._exit``, so the kernel's atexit
handlers never run in it.
"""

from __future__ import annotations

import builtins
import faulthandler
import gc
import importlib.abc
import importlib.util
import io
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet

from taas_magic.process import containment, kernel_debugger
from taas_magic.wire import records
from taas_magic.wire.rank_control import PULL_TOGETHER, STOP_TOGETHER
from taas_magic.wire.records import Record

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
END_SECONDS = 5.0  # the most a rank spends ending what its cell left running


@dataclass(frozen=True)
class RankFds:
    """The rank's ends of its channels to the kernel."""

    stdout: int
    stderr: int
    report: int
    stack: int
    lifeline: int  # read end of a pipe only the supervisor writes: EOF means the supervisor is gone
    sockets: FrozenSet[int] = frozenset()  # inherited sockets this process needs (its delivery channels)
    gate: int | None = None  # read end of a pipe the supervisor holds shut until it has forked every process
    control: int | None = None  # the process's end of its channel with the supervisor (cells, input)
    control_secret: bytes = b""
    ask: int | None = None  # read end of a pipe on which the supervisor asks a rank for its stacks


def wait_at_gate(fds: RankFds) -> bytes:
    """Once set up, before its real work: until the supervisor has forked every process of the run.

    Returns the note the supervisor passed through the gate (empty if none).
    """
    if fds.gate is None:
        return b""
    note = b""
    while chunk := os.read(fds.gate, 1 << 16):  # until end of file: the supervisor closed its end
        note += chunk
    os.close(fds.gate)
    return note


def settle_forked_process() -> None:
    """First steps of any process forked from the kernel or the fork server, before it does anything.

    The parent's whole heap came along: never let the garbage collector walk it (seconds of
    work and copy-on-write faults when the parent's counters were near a full collection); and
    leave the kernel's debugger behind, if the notebook's was on.
    """
    kernel_debugger.forget()
    gc.freeze()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def become_child(fds: RankFds, env: dict[str, str]) -> Any:
    """What every process forked for a run does first; returns the kernel's shell object, if any."""
    settle_forked_process()
    containment.drop_inherited(_own(fds), *_the_kernels_own_files())
    _tie_life_to_supervisor(fds.lifeline)
    _redirect_output(fds.stdout, fds.stderr)
    builtins.print = print_in_one_write(builtins.print, (sys.stdout, sys.stderr))
    _reset_signals(fds.stack)
    os.environ.update(env)
    shell = _detach_from_kernel()
    _look_like_a_script()
    _progress_bars_as_text()
    return shell


def _own(fds: RankFds) -> set[int]:
    """Every descriptor the process was given for its run: the rest it inherited by accident."""
    single = (fds.stdout, fds.stderr, fds.report, fds.stack, fds.lifeline, fds.gate, fds.control, fds.ask)
    return {fd for fd in single if fd is not None} | set(fds.sockets)


def _the_kernels_own_files() -> tuple[set[int], set[str]]:
    """What the kernel's machinery holds open besides sockets and event descriptors, none of a
    rank's business: ipykernel's copies of the kernel's original stdout and stderr (by number),
    the pipes that capture the kernel's output and IPython's history database (by what
    ``/proc/self/fd`` names them; until the rank's own pipes replace them, descriptors 1 and 2
    are the kernel's)."""
    numbers = {getattr(stream, "_original_stdstream_copy", None) for stream in (sys.stdout, sys.stderr)}
    targets = set()
    for fd in (1, 2):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:"):
            targets.add(target)
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    history = getattr(getattr(shell, "history_manager", None), "hist_file", None)
    if isinstance(history, (str, os.PathLike)):
        targets.add(os.path.realpath(history))
    return {fd for fd in numbers if isinstance(fd, int)}, targets


def _tie_life_to_supervisor(lifeline: int) -> None:
    """Kill this rank's whole process group as soon as its supervisor dies, even by kill -9.

    The lifeline thread, not PR_SET_PDEATHSIG, does it: a death signal would end the rank alone
    and leave its DataLoader workers running for seconds. The rank is a subreaper, so what
    its children leave behind stays its to end (``end_descendants``).
    """
    containment.become_subreaper()

    def watch() -> None:
        try:
            while os.read(lifeline, 1):
                pass
        except OSError:
            pass
        os.killpg(0, signal.SIGKILL)

    kernel_debugger.hidden_thread(watch, name="taas-lifeline")


def end_descendants() -> None:
    """Whatever the cell started and left running ends with the rank, even outside its process group.

    They are reaped here too (the rank is a subreaper: all of them are its to reap), so none still
    holds the rank's pipes when it exits: the rank's last output and results are whole at its exit.
    A DataLoader's SIGCHLD handler would take its workers' deaths for a failure: the rank is
    ending, so no handler of the cell's runs any more.
    """
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for pid in containment.descendants(os.getpid()):  # the whole tree first: each kill hands its children to us
        containment.kill(pid, signal.SIGKILL)
    containment.end_all_children(END_SECONDS)


def _redirect_output(stdout_fd: int, stderr_fd: int) -> None:
    """Fds 1 and 2 become the rank's pipes, so C-level writes and child processes are caught too."""
    old_streams = (sys.stdout, sys.stderr)
    for fd, target in ((stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    streams = {"stdout": _text_stream(1), "stderr": _text_stream(2), "stdin": open(0, "r", closefd=False)}
    for name, stream in streams.items():  # the originals too: they are the kernel's, useless here
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    # Loggers and libraries may hold the kernel's stream objects (ZeroMQ-backed, unusable here):
    # make those objects write to the new streams.
    for old, new in zip(old_streams, (sys.stdout, sys.stderr)):
        for name in ("write", "writelines", "flush"):
            try:
                setattr(old, name, getattr(new, name))
            except (AttributeError, TypeError):
                pass


def print_in_one_write(original: Callable[..., None], streams: tuple[Any, ...]) -> Callable[..., None]:
    """``print`` that hands ``streams`` (the process's own stdout and stderr) each call's text in one write.

    The built-in writes each value and separator on its own, and the streams write through to the pipes: a rank
    descheduled between those writes (a busy machine, a slow ``__str__``) sends the kernel a partial line, which
    the kernel shows on its own after a moment of quiet, and the line reaches the notebook in two pieces. Formatted
    first by the built-in itself, the text is exactly what it would have written, errors included. Any other file
    (a redirection, a log file) is printed to as the built-in does."""

    def print(
        *values: object, sep: str | None = " ", end: str | None = "\n", file: Any = None, flush: bool = False
    ) -> None:
        stream = sys.stdout if file is None else file
        if not any(stream is own for own in streams):
            original(*values, sep=sep, end=end, file=file, flush=flush)
            return
        text = io.StringIO()
        original(*values, sep=sep, end=end, file=text)
        if text.tell():
            stream.write(text.getvalue())
        if flush:
            stream.flush()

    print.__doc__ = original.__doc__
    return print


def _text_stream(fd: int) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", line_buffering=True, write_through=True)


def _reset_signals(stack_fd: int) -> None:
    """Interrupts become KeyboardInterrupt (so `finally` runs), SIGTERM ends the rank, SIGUSR1 dumps stacks.

    Any other handler a library installed in the kernel (torch's elastic agent leaves SIGHUP and
    SIGQUIT ones behind) goes back to the default: this process is not that library's.
    """
    for signum in signal.valid_signals():
        try:
            if callable(signal.getsignal(signum)):
                signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError, TypeError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    faulthandler.register(signal.SIGUSR1, file=stack_fd, all_threads=True, chain=False)
    signal.signal(STOP_TOGETHER, as_an_interrupt)  # a session's rank takes it at a step (rank/stopping.py)
    signal.signal(PULL_TOGETHER, signal.SIG_IGN)  # a session's rank answers it in its cell (rank/stopping.py)
    # The supervisor forked this process with interrupts, stack requests and stops held: one sent while it started
    # is taken now (a stack request, by then, is answered rather than ending the process).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGUSR1, STOP_TOGETHER})


def as_an_interrupt(signum: int, frame: Any) -> None:
    """``STOP_TOGETHER`` where a rank cannot stop at a step (before its session, between its cells): the interrupt
    it stands for, raised as SIGINT, so held, ignored or taken as SIGINT is there."""
    signal.raise_signal(signal.SIGINT)


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
        shell.display_pub.publish = print_display_data
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
    decision in already-imported Lightning modules are corrected too. Which modules hold one was
    found before the fork (``find_interactive_flags``): walking every module here would touch
    thousands of shared pages and copy each one.
    """
    for name in ("ps1", "ps2"):
        if hasattr(sys, name):
            delattr(sys, name)
    for name in _interactive_flags:
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, "_IS_INTERACTIVE", False)


def _progress_bars_as_text() -> None:
    """`tqdm.auto` in a rank draws a text bar, as in a script, without its warning about widgets.

    tqdm picks its notebook bar when it finds itself in a kernel, as a forked rank seems to be;
    that bar has no front end to draw in here (and, without ipywidgets, warns once per rank).
    So `tqdm.autonotebook`, tqdm's chooser, is the text bar in a rank: patched where the kernel
    had imported it, else made so on first import (nothing is imported before a cell asks).
    """
    std = sys.modules.get("tqdm.std")
    for name in ("tqdm.auto", "tqdm.autonotebook"):
        module = sys.modules.get(name)
        if module is not None and std is not None:
            module.tqdm, module.trange = std.tqdm, std.trange  # type: ignore[attr-defined]
    if "tqdm.autonotebook" not in sys.modules:
        sys.meta_path.insert(0, _TextBarChooser())


class _TextBarChooser(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `tqdm.autonotebook` as tqdm's text bar (`tqdm.std`)."""

    NAME = "tqdm.autonotebook"

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname == self.NAME else None

    def create_module(self, spec: Any) -> None:
        return None  # the default module

    def exec_module(self, module: Any) -> None:
        from tqdm.std import tqdm, trange  # type: ignore[import-untyped]

        module.tqdm, module.trange = tqdm, trange


_interactive_flags: tuple[str, ...] = ()
_modules_seen = -1  # how many modules were loaded when the flags were last looked for


def find_interactive_flags() -> None:
    """In the process about to fork ranks: the Lightning modules that believe they run interactively.

    Looked for again only when modules were imported since: a kernel holds thousands.
    """
    global _interactive_flags, _modules_seen
    if len(sys.modules) == _modules_seen:
        return
    _modules_seen = len(sys.modules)
    _interactive_flags = tuple(
        name
        for name, module in list(sys.modules.items())
        if name.partition(".")[0] in _LIGHTNING_PACKAGES and getattr(module, "_IS_INTERACTIVE", False)
    )


_LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")


def _no_input(prompt: object = "") -> str:
    raise RuntimeError("input() is not available inside a taas cell's ranks: read input in an earlier cell")


def print_display_data(data: dict[str, Any], metadata: Any = None, **kwargs: Any) -> None:
    text = data.get("text/plain") if isinstance(data, dict) else None
    if text:
        print(text)


def _drop_message(*args: Any, **kwargs: Any) -> None:
    return None


def report(fd: int, record: Record) -> None:
    """One record, whole: a rank's threads (its cell, its vitals sampler) report on the same pipe."""
    with _REPORTING:
        write_all(fd, records.encode(record))


_REPORTING = threading.Lock()
os.register_at_fork(after_in_child=_REPORTING._at_fork_reinit)  # type: ignore[attr-defined]  # held by a thread that is not forked


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
