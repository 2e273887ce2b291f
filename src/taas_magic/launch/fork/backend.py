"""The fork backend: the kernel forks the run's supervisor, which forks the ranks.

The fast start: the supervisor is forked from the kernel, so it and the ranks it forks inherit the
notebook's namespace for free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from taas_magic.launch.backend import Cell
from taas_magic.launch.rendezvous import RunStore
from taas_magic.launch.supervisor.handle import SupervisedRanks, SupervisorProcess
from taas_magic.launch.supervisor.main import supervise
from taas_magic.launch.supervisor.ranks import task_namespace
from taas_magic.process import child, containment
from taas_magic.rank import aliases, worker
from taas_magic.wire import channel

START_SECONDS = 60.0  # a forked supervisor reports its ranks started long before this


@dataclass
class ForkBackend:
    """Ranks forked from the kernel, through a supervisor forked from the kernel."""

    name: str = "fork"

    def prepare(self, task: worker.RankTask, cell: Cell) -> worker.RankTask:
        """Forked ranks have the notebook as it is: the task alone."""
        return task

    def start(self, envs: dict[int, dict[str, str]], task: worker.RankTask) -> SupervisedRanks:
        run_id = envs[min(envs)]["TAAS_RUN_ID"]
        child.find_interactive_flags()  # here, where it touches no page shared with a child
        store = RunStore(envs)
        envs = store.environments(envs)
        kernel_end, supervisor_end = channel.socket_pair()
        secret = channel.new_secret()
        held = containment.HeldInterrupts()  # none is swallowed by the fork's callbacks or lost before the pid is bound
        try:
            pid = os.fork()
        except BaseException:
            containment.to_the_end(kernel_end.close, supervisor_end.close, store.close)
            held.release()
            raise
        if pid == 0:  # the supervisor: never returns into the kernel's code
            try:
                kernel_end.close()
                child.settle_forked_process()
            finally:
                supervise(channel.Channel(supervisor_end, secret, run_id), envs, lambda: task)
        try:  # an interrupt from here on must not leave the supervisor unreaped or the store open
            supervisor_end.close()
            held.release()  # one that came during the fork is raised here
            group = SupervisedRanks(channel.Channel(kernel_end, secret, run_id), SupervisorProcess(pid, is_child=True),
                                    envs, store=store)
        except BaseException:
            containment.end_child(pid)
            containment.to_the_end(supervisor_end.close, kernel_end.close, store.close)
            raise
        try:
            group.go(aliases.find(task_namespace(task)))  # while the supervisor forks: it reads every name once
            group.wait_started(START_SECONDS)
        except BaseException:
            group.close()
            raise
        return group
