"""What the cluster tier's modules share: the cell header of a run on the test cluster's t.2 nodes,
and what a run may not leave behind on any node."""

from __future__ import annotations

import os
import time

import psutil

from support.kernel import Kernel

HEADER = "#!t.2\n#pragma taas --gpus 4 --device cpu\n"


def run_folders() -> list[str]:
    return [name for name in os.listdir("/tmp") if name.startswith("taas-run-")]


def leftovers(k: Kernel) -> str:
    """What a run may not leave: placement groups, run folders, processes of a run (seen from the kernel)."""
    groups = k.value(
        "[g['placement_group_id'] for g in __import__('ray').util.placement_group_table().values() "
        "if g['state'] != 'REMOVED']"
    )
    deadline = time.monotonic() + 3.0  # a run's supervisor is let go as it exits, not waited for
    while (processes := rank_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    found = {"placement groups": groups, "run folders": run_folders(), "rank processes": processes}
    return "; ".join(f"{what}: {items}" for what, items in found.items() if items)


def node_agents() -> list[psutil.Process]:
    return [p for p in psutil.process_iter() if "NodeAgent" in " ".join(cmdline(p))]


def cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def rank_processes() -> list[psutil.Process]:
    """Processes of runs on any node: whatever the agents' fork servers started (supervisors, ranks)."""
    found = []
    for process in psutil.process_iter():
        try:
            if "taas_magic.launch.forkserver.server" in " ".join(
                cmdline(process)
            ) and process.parent().name().startswith("ray::"):
                found += [p for p in process.children(recursive=True) if alive(p)]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, AttributeError):
            continue
    return found
