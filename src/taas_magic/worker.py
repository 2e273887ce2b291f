"""A rank's job: bind it to its place in the job, run the cell, send results and failures back.

The process around it is set up by ``child.py``; what the rank runs arrives as a ``RankTask``,
inherited by fork or, from the fork server, shipped with the names the cell needs.
"""

from __future__ import annotations

import linecache
import os
import sys
import time
import traceback
from dataclasses import dataclass
from types import CodeType
from typing import Any

from . import results, storage, tempfiles
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
    write_all,
)


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


def run_rank(task: RankTask, env: dict[str, str], fds: RankFds) -> int:
    """Become a rank and run the cell; returns the exit status for ``os._exit``."""
    shell = become_child(fds, env)
    tempfiles.name_multiprocessing_folders()
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
                finish(lambda record: report(fds.report, record))
        flush_all()
        end_descendants()
        tempfiles.remove_multiprocessing_folders()


def _namespace(task: RankTask, shell: Any) -> dict[str, Any]:
    if task.namespace is not None:
        if task.source:
            linecache.cache[task.code.co_filename] = (len(task.source), None, task.source.splitlines(True),
                                                      task.code.co_filename)
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
    shell.display_pub.publish = print_display_data


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


