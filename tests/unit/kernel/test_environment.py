"""Per-rank environments: torchrun's variables for every rank, and nothing changed in the kernel."""

from __future__ import annotations

import os

import pytest

from taas_magic.configurations import load_catalog
from taas_magic.kernel.header.spec import LaunchSpec
from taas_magic.kernel.running import environment
from taas_magic.kernel.running.environment import TORCHRUN_VARIABLES, loopback_interface, rank_environments

RUN_ID = "run-1234"
PORT = 41234


def launch(
    world_size: int = 4, device: str = "cpu", nodes: int = 1, configuration: str | None = None, threads: int = 3
) -> LaunchSpec:
    return LaunchSpec(
        world_size=world_size,
        nodes=nodes,
        ranks_per_node=world_size // nodes,
        device=device,
        configuration=load_catalog({}).get(configuration) if configuration else None,
        cpus=None,
        units=None,
        output="all",
        timeout=None,
        threads_per_rank=threads,
    )


@pytest.fixture
def loopback(monkeypatch):
    """Pretend the machine has a loopback interface named `lo`, whatever this one has."""
    monkeypatch.setattr(environment, "loopback_interface", lambda: "lo")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_rank_has_every_torchrun_variable(device: str) -> None:
    envs = rank_environments(launch(device=device), RUN_ID, PORT, {})
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, env in envs.items():
        assert set(TORCHRUN_VARIABLES) <= set(env)
        assert all(isinstance(value, str) for value in env.values())
        assert {name: env[name] for name in TORCHRUN_VARIABLES} == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": "4",
            "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(PORT),
            "TORCHELASTIC_RUN_ID": RUN_ID,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
        }


def test_ranks_are_distinct_and_the_rendezvous_is_shared() -> None:
    envs = rank_environments(launch(world_size=8), RUN_ID, PORT, {})
    assert sorted(int(env["RANK"]) for env in envs.values()) == list(range(8))
    assert sorted(int(env["LOCAL_RANK"]) for env in envs.values()) == list(range(8))
    assert {env["MASTER_PORT"] for env in envs.values()} == {str(PORT)}
    assert {env["TORCHELASTIC_RUN_ID"] for env in envs.values()} == {RUN_ID}
    assert {env["TAAS_RUN_ID"] for env in envs.values()} == {RUN_ID}


def test_ranks_get_separate_dictionaries() -> None:
    envs = rank_environments(launch(world_size=2), RUN_ID, PORT, {})
    envs[0]["ONLY_RANK_0"] = "1"
    assert "ONLY_RANK_0" not in envs[1]


def test_taas_variables() -> None:
    env = rank_environments(launch(device="cuda", configuration="g2.8", threads=5), RUN_ID, PORT, {})[0]
    assert env["OMP_NUM_THREADS"] == "5"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["TAAS_DEVICE"] == "cuda"
    assert env["TAAS_CONFIGURATION"] == "g2.8"
    assert rank_environments(launch(), RUN_ID, PORT, {})[0]["TAAS_CONFIGURATION"] == ""


def test_cuda_visible_devices_is_emptied_only_for_cpu() -> None:
    for env in rank_environments(launch(device="cpu"), RUN_ID, PORT, {}).values():
        assert env["CUDA_VISIBLE_DEVICES"] == ""
    for env in rank_environments(launch(device="cuda"), RUN_ID, PORT, {"CUDA_VISIBLE_DEVICES": "0,1"}).values():
        assert "CUDA_VISIBLE_DEVICES" not in env  # the kernel's own choice is inherited


def test_second_node_numbers_its_ranks_after_the_first() -> None:
    envs = rank_environments(launch(world_size=8, nodes=2), RUN_ID, PORT, {}, node_rank=1)
    assert sorted(envs) == [4, 5, 6, 7]
    assert [envs[rank]["LOCAL_RANK"] for rank in sorted(envs)] == ["0", "1", "2", "3"]
    assert {env["GROUP_RANK"] for env in envs.values()} == {"1"}
    assert {(env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) for env in envs.values()} == {
        ("8", "4", "2")
    }


def test_one_node_run_stays_on_loopback(loopback) -> None:
    for env in rank_environments(launch(), RUN_ID, PORT, {}).values():
        assert env["GLOO_SOCKET_IFNAME"] == "lo"
        assert env["NCCL_SOCKET_IFNAME"] == "lo"


def test_users_socket_interface_is_not_overridden(loopback) -> None:
    kernel_environ = {"GLOO_SOCKET_IFNAME": "eth0"}
    for env in rank_environments(launch(), RUN_ID, PORT, kernel_environ).values():
        assert "GLOO_SOCKET_IFNAME" not in env  # the rank inherits eth0 from the kernel
        assert env["NCCL_SOCKET_IFNAME"] == "lo"


def test_no_interface_chosen_without_loopback_or_across_nodes(monkeypatch) -> None:
    monkeypatch.setattr(environment, "loopback_interface", lambda: None)
    env = rank_environments(launch(), RUN_ID, PORT, {})[0]
    assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_SOCKET_IFNAME" not in env
    monkeypatch.setattr(environment, "loopback_interface", lambda: "lo")
    env = rank_environments(launch(world_size=8, nodes=2), RUN_ID, PORT, {})[0]
    assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_SOCKET_IFNAME" not in env


def test_kernel_environment_is_not_changed(loopback) -> None:
    kernel_environ = {"GLOO_SOCKET_IFNAME": "eth0", "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0"}
    kernel_before = dict(kernel_environ)
    os_before = dict(os.environ)
    rank_environments(launch(device="cpu"), RUN_ID, PORT, kernel_environ)
    rank_environments(launch(device="cuda"), RUN_ID, PORT, os.environ)
    assert kernel_environ == kernel_before
    assert dict(os.environ) == os_before


def test_loopback_interface_is_a_loopback_name_or_none() -> None:
    name = loopback_interface()
    assert name is None or name.startswith("lo")


def test_cpu_runs_tell_accelerate_to_use_the_cpu() -> None:
    """Accelerate's Accelerator() joins a CPU run (MULTI_CPU on gloo) only when told to use the CPU."""
    for env in rank_environments(launch(device="cpu"), RUN_ID, PORT, {}).values():
        assert env["ACCELERATE_USE_CPU"] == "true"
    for env in rank_environments(launch(device="cuda"), RUN_ID, PORT, {}).values():
        assert "ACCELERATE_USE_CPU" not in env


@pytest.mark.parametrize(
    "hang_after, kernel, expected",
    [
        (120.0, {}, "64"),  # a small ring: what the watchdog needs, cheap to read each second
        (120.0, {"TORCH_FR_BUFFER_SIZE": "2000"}, None),  # the user's choice stays (the ranks inherit it)
        (120.0, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "10"}, None),
        (0.0, {}, None),  # no watchdog: torch's own default, as without taas
    ],
)
def test_the_flight_recorder_is_sized_for_the_watchdog_unless_the_user_chose(hang_after, kernel, expected) -> None:
    import dataclasses

    spec = dataclasses.replace(launch(2), hang_after=hang_after)
    envs = rank_environments(spec, RUN_ID, PORT, kernel)
    assert {env.get("TORCH_FR_BUFFER_SIZE") for env in envs.values()} == {expected}
