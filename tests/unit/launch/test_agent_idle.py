"""When a cluster node's agent leaves on its own (launch/cluster/agent.py), without Ray: never between the
calls of a launch, however far apart a saturated machine puts them."""

from __future__ import annotations

import threading
import time

from taas_magic.launch.cluster.agent import NodeAgent


def _agent(idle_seconds: float) -> NodeAgent:
    """The agent's state as its constructor leaves it, without the Ray actor and fork server around it."""
    agent = object.__new__(NodeAgent)
    agent.group, agent.idle_seconds, agent.address = None, idle_seconds, "127.0.0.1"
    agent.last_used, agent.held_until, agent.lock = time.monotonic(), 0.0, threading.RLock()
    return agent


def test_an_agent_unused_for_its_idle_seconds_leaves() -> None:
    agent = _agent(3)
    now = time.monotonic()
    assert not agent.unused(now + 1) and agent.unused(now + 4)


def test_a_launch_holds_the_agent_until_its_run_starts_however_late_the_next_call() -> None:
    agent = _agent(3)
    agent.info(hold_for=300)  # the kernel's first call of a launch
    now = time.monotonic()
    assert not agent.unused(now + 60), "the launch's next call may come a minute later on a busy machine"
    assert agent.unused(now + 301), "a launch that never came to its start lets the agent go in the end"
    agent.info()  # a plain question holds nothing more
    assert agent.unused(now + 301)


def test_a_running_group_keeps_the_agent_whatever_the_time() -> None:
    agent = _agent(3)
    agent.group = object()  # type: ignore[assignment]
    assert not agent.unused(time.monotonic() + 10_000)
