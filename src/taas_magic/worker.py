"""A rank's job: bind it to its place in the job, run the cell, send results and failures back.

The process around it is set up by ``child.py``; what the rank runs arrives as a ``RankTask``,
inherited by fork or, from the fork server, shipped with the names the cell needs.
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

from . import debugger, plugins, progress, results, session_rank, storage, tempfiles, vitals
from .aliases import rebind
from .cell_names import code_names
from .child import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    RankFds,
    become_child,
    end_descendants,
    flush_all,
    print_display_data,
    report,
    wait_at_gate,
    write_all,
)
from .rank_state import TorchSettings, seed_rank
from .records import CellEnded, DeliverySummary, Failed


@dataclass(frozen=True)
class KernelContext:
    """The kernel's process state that spawned ranks must see as forked ones do.

    The fork server takes on the environment, folder and ``sys.path`` (``apply``); torch's
    settings are applied in each rank, so the server itself stays as it started.
    """

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]
    torch_settings: TorchSettings

    @classmethod
    def of_this_process(cls) -> "KernelContext":
        return cls(dict(os.environ), os.getcwd(), list(sys.path), TorchSettings.of_this_process())

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path


@dataclass(frozen=True)
class RankTask:
    """What every rank runs: the cell's compiled code, and how to bind the rank to its device."""

    code: CodeType
    device: str  # "cuda" or "cpu"
    threads: int  # intra-op threads on CPU
    return_names: tuple[str, ...] = ()  # what rank 0 sends back into the notebook
    namespace: dict[str, Any] | None = None  # spawned ranks: the shipped names; forked: the kernel's own
    # The notebook's cells by file name: (label, code), for tracebacks where the kernel's line cache
    # is not inherited: {".../ipykernel_1/2.py": ("Cell In[5]", "x = 1\n")}.
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)
    loaders: tuple[Any, ...] = ()  # delivery plans of the registered loaders the cell uses
    context: KernelContext | None = None  # spawned ranks: the kernel's environment, folder, sys.path, torch settings
    seed: int | None = None  # the run's base seed, drawn in the kernel; each rank derives its own (rank_state.py)
    delivery: Any = None  # on a cluster node: its share of data delivery (a NodeEnds, attached once unpacked)
    keep: bool = False  # a session: the ranks stay, running the cells they are sent (session_rank.py)
    idle_limit: float | None = None  # a session ends after this many seconds without a cell
    debug: bool = False  # a rank whose cell raised stays, paused, for the debugger (``%taas debug``)

    def run(self, env: dict[str, str], fds: "RankFds") -> int:
        return run_rank(self, env, fds)


def run_rank(task: RankTask, env: dict[str, str], fds: RankFds) -> int:
    """Become a rank and run the cell; returns the exit status for ``os._exit``."""
    shell = become_child(fds, env)
    tempfiles.name_multiprocessing_folders()
    namespace = _namespace(task, shell)
    _exit_ends_the_rank(namespace)
    if task.context is not None:
        task.context.torch_settings.apply()  # forked ranks inherited them
    plugins.use()
    rank = int(env["RANK"])
    replaced = [_bind_device(task, int(env["LOCAL_RANK"])),
                storage.guard_torch_save(rank, lambda record: report(fds.report, record), env.get("TAAS_NODE_ADDRESS"))]
    for plan in task.loaders:
        namespace[plan.name] = plan.stand_in(rank, namespace[plan.name], task.device)
    if task.seed is not None:
        seed_rank(task.seed, rank, task.device)
    aliases = _aliases(wait_at_gate(fds))
    for pair in replaced:
        if pair is not None:
            rebind(namespace, aliases, *pair)
    shell = shell if task.namespace is None else None
    progress.attach(lambda record: report(fds.report, record))
    vitals.attach(lambda record: report(fds.report, record), int(env["LOCAL_RANK"]) if task.device == "cuda" else None)
    control = session_rank.open_control(fds)
    if control is not None:
        debugger.take_breakpoints(control)
    try:
        if task.keep and control is not None:
            return session_rank.serve(task, namespace, shell, fds, control)
        status, error = _execute(task, namespace, shell, fds, send_results=rank == 0)
        if error is not None and task.debug and control is not None:
            session_rank.await_debugger(error, control)
        return status
    finally:
        for plan in task.loaders:
            finish = getattr(namespace.get(plan.name), "finish", None)
            if finish is not None:
                finish(lambda record: report(fds.report, record))
        flush_all()
        end_descendants()
        tempfiles.remove_multiprocessing_folders()


def _namespace(task: RankTask, shell: Any) -> dict[str, Any]:
    if task.namespace is not None:
        if "get_ipython" in code_names(task.code):
            _standalone_shell(task.namespace)
        return task.namespace
    return shell.user_ns if shell is not None else {"__name__": "__main__"}


def _standalone_shell(namespace: dict[str, Any]) -> None:
    """IPython syntax (magics, `!cmd`) in a spawned rank: a shell of its own over the rank's namespace."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False  # no history database for a rank
    shell = InteractiveShell.instance(config=config, user_ns=namespace)
    setattr(shell.display_pub, "publish", print_display_data)


def _exit_ends_the_rank(namespace: dict[str, Any]) -> None:
    """`exit()` / `quit()` end the rank as `sys.exit()` does, `exit(3)` fails it as `sys.exit(3)` does.

    IPython's own (the kernel's, or a spawned rank's shell's) would ask a shell to stop after the
    cell. ``sys.exit`` itself replaces them: a builtin adds no frame to the traceback. A user's
    own `exit` stays.
    """
    try:
        from IPython.core.autocall import ExitAutocall
    except ImportError:
        return
    for name in ("exit", "quit"):
        if isinstance(namespace.get(name), ExitAutocall):
            namespace[name] = sys.exit


def _aliases(note: bytes) -> tuple[str, ...] | None:
    """The notebook's names for functions this rank replaced, as the kernel found them while the
    ranks were forked (``aliases.find``); None, to look at every name, when the note is missing."""
    try:
        names = json.loads(note)
    except ValueError:
        return None
    return tuple(names) if isinstance(names, list) else None


def _bind_device(task: RankTask, local_rank: int) -> tuple[Any, Any] | None:
    """The rank's device and threads; on CPU, returns (init_process_group, its replacement)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if task.device == "cuda":
        torch.cuda.set_device(local_rank)
        return None
    torch.set_num_threads(task.threads)
    return _serve_nccl_with_gloo()


def _serve_nccl_with_gloo() -> tuple[Any, Any]:
    """On CPU a notebook written for GPUs runs unchanged: backend "nccl" is given to gloo."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.init_process_group
    noticed: list[bool] = []

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if str(backend).lower() == "nccl":
            if not noticed and os.environ.get("RANK") == "0":
                noticed.append(True)
                print("taas: --device cpu: backend 'nccl' is served by 'gloo'", file=sys.stderr)
            backend = "gloo"
        return original(backend, *args, **kwargs)

    dist.init_process_group = c10d.init_process_group = init_process_group
    return original, init_process_group


def _execute(task: RankTask, namespace: dict[str, Any], shell: Any, fds: RankFds,
             send_results: bool) -> tuple[int, BaseException | None]:
    """A one-shot cell: run it, then results (rank 0) and how it ended go down their pipes."""
    status, record, data, error = run_cell(task.code, task.return_names if send_results else None, namespace,
                                           shell, task)
    if send_results:
        try:
            write_all(fds.results, data or b"")
        finally:
            os.close(fds.results)
    report(fds.report, record)
    return status, error


def run_cell(code: CodeType, return_names: tuple[str, ...] | None, namespace: dict[str, Any], shell: Any,
             task: RankTask) -> tuple[int, CellEnded | Failed, bytes | None, BaseException | None]:
    """Run one cell's code: (exit status, how it ended, rank 0's pickled names, the error it raised).

    ``return_names`` is None in ranks that send nothing back.
    """
    _delivery_summaries(task, namespace)  # a session cell sums up its own loops, not those of one that failed
    exited = None  # how the cell ended early without failing: "sys.exit(0)"
    try:
        try:
            with vitals.sampling():
                exec(code, namespace)
        finally:
            progress.flush()
    except SystemExit as e:
        if e.code not in (None, 0):
            return _failure(e, shell, task, f"the cell called sys.exit({e.code!r})") + (None, e)
        exited = "sys.exit()" if e.code is None else f"sys.exit({e.code!r})"
    except BaseException as e:
        return _failure(e, shell, task) + (None, e)
    ended = time.monotonic()  # compared with other ranks' failures: did this rank leave before them?
    data, skipped = _results(return_names, namespace) if return_names is not None else (None, {})
    return 0, CellEnded(ended, skipped, _delivery_summaries(task, namespace), exited or ""), data, None


def stopped_before_start(error: KeyboardInterrupt, shell: Any, task: RankTask) -> tuple[int, Failed]:
    """How a session's cell ended that an interrupt stopped before its code began."""
    return _failure(error, shell, task)


def _delivery_summaries(task: RankTask, namespace: dict[str, Any]) -> dict[str, DeliverySummary]:
    """How each stand-in loader the cell iterated fared in this rank: elements received, time spent waiting."""
    summaries = {plan.name: namespace[plan.name].summary() for plan in task.loaders
                 if hasattr(namespace.get(plan.name), "summary")}
    return {name: summary for name, summary in summaries.items() if summary is not None}


def _results(names: tuple[str, ...], namespace: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The cell's names, pickled for the kernel; and {name: why} for those left out."""
    present = {name: namespace[name] for name in names if name in namespace}
    data, skipped = results.dumps(present) if present else (b"", {})
    skipped.update({name: results.NOT_BOUND for name in names if name not in namespace})
    return data, skipped


def _failure(error: BaseException, shell: Any, task: RankTask, summary: str | None = None) -> tuple[int, Failed]:
    when = time.monotonic()  # before formatting: the earliest failure is the root cause
    flush_all()
    interrupted = isinstance(error, KeyboardInterrupt)
    # An interrupt taas sent is not shown; one the cell raised itself is a failure like any other.
    record = Failed(when, type(error).__name__, summary or str(error), format_traceback(error, shell, task),
                    interrupted=interrupted, hint=_hint(error, task))
    return (EXIT_INTERRUPTED if interrupted else EXIT_FAILED), record


# What torch says when a CPU-only rank asks for CUDA (no driver, no device visible, a CPU-only build).
_NO_CUDA = ("found no nvidia driver", "no cuda gpus are available", "torch not compiled with cuda enabled",
            "no cuda-capable device is detected", "cuda driver initialization failed")


def _hint(error: BaseException, task: RankTask) -> str:
    """One line of advice for mistakes taas can recognize; empty otherwise."""
    if task.device == "cpu" and any(phrase in str(e).lower() for e in _chain(error) for phrase in _NO_CUDA):
        return ("this run is on CPU (--device cpu), so CUDA is not available in its ranks: "
                "taas.device() gives each rank its device on CPU and CUDA runs alike")
    return ""


def _chain(error: BaseException) -> list[BaseException]:
    """The error and those it was raised from or during, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain and len(chain) < 10:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


_cell_labels: dict[str, str] = {}  # file name -> "Cell In[5]", in processes that unpacked shipped cells


def register_sources(sources: dict[str, tuple[str, str]]) -> None:
    """Make the notebook's cells readable where the kernel's line cache is not inherited (before the
    ranks and producers are forked): tracebacks then quote their lines, and name them as IPython does."""
    numbers = _shell_cell_numbers()
    for filename, (label, code) in sources.items():
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        _cell_labels[filename] = label
        if numbers is not None and label.startswith("Cell In[") and label[8:-1].isdigit():
            numbers[filename] = int(label[8:-1])  # a forked rank's shell: its tracebacks say "Cell In[n]" too


def _shell_cell_numbers() -> dict[str, int] | None:
    """The kernel's own map of cell file names to numbers, in a rank forked from it (None elsewhere)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None)
    return numbers if isinstance(numbers, dict) else None


def format_traceback(error: BaseException, shell: Any, task: RankTask | None = None) -> list[str]:
    """The traceback as IPython would show it in the kernel, without this module's frame."""
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None
    try:
        if shell is not None:
            return list(shell.InteractiveTB.structured_traceback(type(error), error, tb))
        lines = _standalone_formatter().structured_traceback(type(error), error, tb)
        for filename, label in _cell_labels.items():
            lines = [line.replace(filename, label) for line in lines]
        return list(lines)
    except Exception:
        return traceback.format_exception(type(error), error, tb)


def _standalone_formatter() -> Any:
    from IPython.core.ultratb import AutoFormattedTB

    try:
        return AutoFormattedTB(mode="Context", theme_name="linux")
    except TypeError:  # IPython 8
        return AutoFormattedTB(mode="Context", color_scheme="Linux")  # type: ignore[call-arg]


