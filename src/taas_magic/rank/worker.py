"""A rank's job: bind it to its place in the job, run the cell, send results and failures back.

The process around it is set up by ``process/child.py``; what the rank runs arrives as a ``RankTask`` (``wire.task``),
inherited by fork or, from the fork server, shipped with the names the cell needs.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from taas_magic.cell_names import code_names
from taas_magic.delivery.cluster_ends import FedLoader
from taas_magic.delivery.service import RankLoader
from taas_magic.process import tempfiles
from taas_magic.process.child import (
    RankFds,
    become_child,
    end_descendants,
    flush_all,
    print_display_data,
    report,
    wait_at_gate,
)
from taas_magic.rank import debugger, plugins, progress, session, storage, visual_debugging, vitals
from taas_magic.rank.aliases import rebind
from taas_magic.rank.cell import release_termination, run_cell
from taas_magic.rank.state import seed_rank
from taas_magic.wire.rank_control import RankEnd
from taas_magic.wire.task import RankTask


def run_rank(
    task: RankTask,
    env: dict[str, str],
    fds: RankFds,
    stand_ins: tuple[RankLoader | FedLoader, ...] = (),
    shipped: dict[str, Any] | None = None,
) -> int:
    """Become a rank and run the cell; returns the exit status for ``os._exit``.

    ``stand_ins``: what builds the stand-in of each registered loader the cell uses, in the rank.
    """
    shell = become_child(fds, env)
    tempfiles.name_multiprocessing_folders()
    namespace = _namespace(task, shell, shipped)
    _exit_ends_the_rank(namespace)
    if task.context is not None:
        task.context.torch_settings.apply()  # forked ranks inherited them
    plugins.use()
    rank = int(env["RANK"])
    replaced = [
        _bind_device(task, int(env["LOCAL_RANK"])),
        storage.guard_torch_save(rank, lambda record: report(fds.report, record), env.get("TAAS_NODE_ADDRESS")),
    ]
    for loader in stand_ins:
        namespace[loader.name] = loader.stand_in(rank, namespace[loader.name], task.device)
    if task.seed is not None:
        seed_rank(task.seed, rank, task.device)
    aliases = _aliases(wait_at_gate(fds))
    for pair in replaced:
        if pair is not None:
            rebind(namespace, aliases, *pair)
    shell = shell if shipped is None else None
    progress.attach(lambda record: report(fds.report, record))
    vitals.attach(
        lambda record: report(fds.report, record),
        int(env["LOCAL_RANK"]) if task.device == "cuda" else None,
        track=task.track,
        asked=fds.ask,
        stack_fd=fds.stack,
    )
    control = session.open_control(fds)
    if control is not None:
        debugger.take_breakpoints(control)
    try:
        if task.keep and control is not None:
            return session.serve(task, namespace, shell, fds, control)
        status, error = _execute(task, namespace, shell, fds, control)
        if error is not None and task.debug and control is not None:
            session.await_debugger(error, control)
        return status
    finally:
        for plan in task.order.loaders:
            finish = getattr(namespace.get(plan.name), "finish", None)
            if finish is not None:
                finish(lambda record: report(fds.report, record))
        flush_all()
        visual_debugging.leave()
        end_descendants()
        tempfiles.remove_multiprocessing_folders()


def _namespace(task: RankTask, shell: Any, shipped: dict[str, Any] | None) -> dict[str, Any]:
    if shipped is not None:
        if task.order.code is not None and "get_ipython" in code_names(task.order.code):
            _standalone_shell(shipped)
        return shipped
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


def _execute(
    task: RankTask, namespace: dict[str, Any], shell: Any, fds: RankFds, control: RankEnd | None
) -> tuple[int, BaseException | None]:
    """A one-shot cell: run it, then say how it ended: with its names, on the control channel, where the rank
    sends names (``session.send_end``); on its report pipe otherwise."""
    status, record, names, error = run_cell(
        task.order,
        namespace,
        shell,
        task,
        task.order.loaders,
        report_early=lambda early: report(fds.report, early),
    )
    try:
        if names is not None and control is not None:
            session.send_end(control, record, names)
        else:
            report(fds.report, record)
    finally:
        release_termination()
    return status, error
