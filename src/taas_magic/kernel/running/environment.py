"""Per-rank environments: what torchrun would set, plus taas's own variables.

Pure data: ``{rank: {name: value}}``, checked for completeness, applied only inside each rank.
The kernel's own ``os.environ`` is never changed.
"""

from __future__ import annotations

import socket
from functools import lru_cache
from typing import Mapping

from taas_magic.kernel.header.spec import LaunchSpec
from taas_magic.launch.backend import Launch
from taas_magic.process import logs

TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)


FLIGHT_RECORDER_ENTRIES = "64"  # enough for a diagnosis; reading the ring each second costs little


def rank_environments(
    spec: LaunchSpec,
    run_id: str,
    master_port: int,
    kernel_environ: Mapping[str, str],
    node_rank: int | None = None,
    restart: int = 0,
    elastic_id: str | None = None,
) -> dict[int, dict[str, str]]:
    """The variables each rank of node ``node_rank`` (of every node by default) adds to the environment
    it starts in: the kernel's, or its node's. ``restart`` counts the runs started again after a
    failure; ``elastic_id`` is the first run's id, which torchrun keeps across restarts."""
    shared = _shared(spec, run_id, master_port, kernel_environ, restart, elastic_id or run_id)
    envs = {}
    nodes = range(spec.nodes) if node_rank is None else (node_rank,)
    for node_rank, local_rank in ((node, local) for node in nodes for local in range(spec.ranks_per_node)):
        rank = node_rank * spec.ranks_per_node + local_rank
        envs[rank] = {
            **shared,
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "GROUP_RANK": str(node_rank),
            "ROLE_RANK": str(rank),
        }
    for rank, env in envs.items():
        missing = [name for name in TORCHRUN_VARIABLES if name not in env]
        if missing:
            raise ValueError(f"rank {rank} environment lacks {missing}")
    return envs


def launch(
    spec: LaunchSpec, run_id: str, kernel_environ: Mapping[str, str], restart: int = 0, elastic_id: str | None = None
) -> Launch:
    """One start of ``spec``'s ranks as run ``run_id``: every rank's environment, its MASTER_PORT left
    for the backend to open (on a socket it holds for the run alone)."""
    return Launch(run_id, rank_environments(spec, run_id, 0, kernel_environ, restart=restart, elastic_id=elastic_id))


def _shared(
    spec: LaunchSpec, run_id: str, master_port: int, kernel_environ: Mapping[str, str], restart: int, elastic_id: str
) -> dict[str, str]:
    env = {
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(spec.ranks_per_node),
        "GROUP_WORLD_SIZE": str(spec.nodes),
        "ROLE_WORLD_SIZE": str(spec.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": elastic_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "OMP_NUM_THREADS": str(spec.threads_per_rank),
        "PYTHONUNBUFFERED": "1",
        "TAAS_RUN_ID": run_id,
        "TAAS_DEVICE": spec.device,
        "TAAS_CONFIGURATION": spec.configuration.name if spec.configuration else "",
        **logs.variables(spec.log, elastic_id),  # one log for the cell, its restarts too
    }
    if spec.hang_after and not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(kernel_environ):
        # torch's flight recorder: where each rank is in its collectives (rank.activity reads it)
        env["TORCH_FR_BUFFER_SIZE"] = FLIGHT_RECORDER_ENTRIES
    if spec.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # code that asks torch.cuda.is_available() picks the CPU
        env["ACCELERATE_USE_CPU"] = "true"  # Accelerate's Accelerator() then joins the run on gloo (MULTI_CPU)
    interface = loopback_interface()
    if spec.nodes == 1 and interface:
        # Keep gloo and NCCL's bootstrap on loopback for a one-node run, unless the user chose.
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in kernel_environ:
                env[name] = interface
    return env


@lru_cache(maxsize=1)
def loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return "lo" if "lo" in names else next((n for n in names if n.startswith("lo")), None)
