"""The fork backend: the kernel forks the run's supervisor, which forks the ranks.

The fast start: the supervisor is forked from the kernel, so it and the ranks it forks inherit the
notebook's namespace for free.
"""

from __future__ import annotations

from dataclasses import dataclass

from taas_magic.launch.backend import Cell, Launch, MakeTask
from taas_magic.launch.rendezvous import RunStore
from taas_magic.launch.supervisor.handle import SupervisedRanks, SupervisorProcess
from taas_magic.launch.supervisor.main import supervise
from taas_magic.launch.supervisor.tasks import Received, kernel_namespace
from taas_magic.process import child, containment, kernel_debugger
from taas_magic.rank import aliases
from taas_magic.wire import channel, supervision
from taas_magic.wire.task import RankTask

START_SECONDS = 60.0  # a forked supervisor reports its ranks started long before this


@dataclass(frozen=True)
class ForkPlan:
    """A run of forked ranks: the task alone, as they have the notebook as it is."""

    task: RankTask
    holding: None = None  # the ranks hold the whole notebook, as it is when they fork

    def close(self) -> None:
        pass  # nothing of it is held apart from the kernel's own memory


@dataclass
class ForkBackend:
    """Ranks forked from the kernel, through a supervisor forked from the kernel."""

    name: str = "fork"

    def prepare(self, make_task: MakeTask, cell: Cell) -> ForkPlan:
        """Forked ranks inherit the kernel's line cache and process state: nothing travels with the task."""
        return ForkPlan(make_task(sources={}, context=None))

    def start(self, plan: ForkPlan, launch: Launch) -> SupervisedRanks:
        """The run's supervisor forked and its ranks started, with interrupts held all along: one that comes
        is noted, ends the start (its wait asks) and is raised once the run is freed. Let through, it could
        land anywhere between the fork and the freeing of the run (Python raises a pending interrupt as any
        function begins), and leave the supervisor unreaped, the channel and the store's port open, for good.
        Held, it is not swallowed by the fork's callbacks either, nor lost before the pid is bound."""
        with containment.HeldInterrupts() as held:
            return self._start(plan, launch, held)

    def _start(self, plan: ForkPlan, launch: Launch, held: containment.HeldInterrupts) -> SupervisedRanks:
        task, run_id, envs = plan.task, launch.run_id, launch.envs
        child.find_interactive_flags()  # here, where it touches no page shared with a child
        store = RunStore(envs)
        envs = store.environments(envs)
        kernel_end, supervisor_end = channel.socket_pair()
        secret = channel.new_secret()
        try:
            pid = kernel_debugger.fork()
        except BaseException:
            containment.to_the_end(kernel_end.close, supervisor_end.close, store.close)
            raise
        if pid == 0:  # the supervisor: never returns into the kernel's code
            try:
                kernel_end.close()
                child.settle_forked_process()
            finally:
                supervise(supervision.supervisor_end(supervisor_end, secret, run_id), envs, lambda: Received(task))
        try:
            supervisor_end.close()
            group = SupervisedRanks(
                supervision.kernel_end(kernel_end, secret, run_id),
                SupervisorProcess(pid, is_child=True),
                envs,
                store=store,
            )
        except BaseException:
            containment.end_child(pid)
            containment.to_the_end(supervisor_end.close, kernel_end.close, store.close)
            raise
        try:
            group.go(aliases.find(kernel_namespace()))  # while the supervisor forks: it reads every name once
            group.wait_started(START_SECONDS, interrupted=lambda: held.came)
            if held.came:  # as the ranks started: the run ends before the cell's code sees it
                raise KeyboardInterrupt
        except BaseException:
            group.close()
            raise
        return group
