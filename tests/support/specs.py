"""The launch spec of a plain one-machine run on CPU, as the unit tests of the controller and of sessions
start their scripted groups with."""

from __future__ import annotations

from taas_magic.kernel.header.spec import LaunchSpec


def cpu_spec(world_size: int = 2, timeout: float | None = None) -> LaunchSpec:
    return LaunchSpec(
        world_size=world_size,
        nodes=1,
        ranks_per_node=world_size,
        device="cpu",
        configuration=None,
        cpus=None,
        units=None,
        output="all",
        timeout=timeout,
        threads_per_rank=1,
    )
