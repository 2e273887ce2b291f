"""What the cluster tier's modules share: the cell header of a run on the test cluster's t.2 nodes,
and what a run may not leave behind on any node.

Processes and folders are this test process's when they carry its temporary folder (tests/conftest.py):
another worker's cluster may run beside it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time

import psutil

from support.cells import indices_loader
from support.kernel import Kernel

HEADER = "#!t.2\n#pragma taas --gpus 4 --device cpu\n"


def header(options: str) -> str:
    """``HEADER`` with more options: ``header("--keep")``."""
    return HEADER.replace("--device cpu", f"--device cpu {options}")


INIT = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"


def own_ray(address: str) -> str:
    """A notebook's own use of Ray, beside taas's (whose driver is a process of its own): code that connects
    the kernel itself to the cluster at ``address``, once. Without it, Ray's first call would connect to
    whichever cluster on this machine started last, another worker's, say."""
    return _own_ray(repr(address))


def _own_ray(address: str) -> str:
    return f"import ray\nray.is_initialized() or ray.init(address={address}, log_to_driver=False)\n"


# The registered loader of the delivery tests: element i is (i, the last number of the address of the node
# that built it).
DATA = indices_loader("int(os.environ.get('TAAS_NODE_ADDRESS', '0.0.0.0').split('.')[-1])")

# A cell that prints, for each rank, what it drew from ``loader`` in two passes and where it was built.
COLLECT = """seen = [[b[:, 0].tolist() for b in loader] for epoch in range(2)]
built = sorted({node for b in loader for node in b[:, 1].tolist()})
print("GOT " + json.dumps({"rank": taas.rank(), "len": len(loader), "passes": seen, "built": built}))
"""


def collected(result) -> dict[int, dict]:
    """What each rank of a ``COLLECT`` cell printed, by rank."""
    found = {}
    for match in re.finditer(r"GOT (\{.*\})", result.stdout):
        record = json.loads(match[1])
        found[record["rank"]] = record
    return found


def first_match(k: Kernel, msg_id: str, pattern: str, timeout: float = 120) -> re.Match | None:
    """The first match of ``pattern`` in what the running cell ``msg_id`` prints, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = k.client.get_iopub_msg(timeout=1)
        except Exception:
            continue
        text = msg["content"].get("text", "") if msg["parent_header"].get("msg_id") == msg_id else ""
        match = re.search(pattern, text)
        if match:
            return match
    return None


def error_of(k: Kernel, msg_id: str, since: float) -> tuple[dict | None, float]:
    """The error the running cell ``msg_id`` ends with (None if it succeeds), and when: seconds after ``since``."""
    error, seconds = None, 0.0
    while True:
        msg = k.client.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            error, seconds = msg["content"], time.monotonic() - since
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return error, seconds


def network(addresses: list[str]) -> str:
    """``"127.0.10."`` for a cluster whose nodes are 127.0.10.2, 127.0.10.3, ...: how its addresses begin."""
    return addresses[0].rsplit(".", 1)[0] + "."


def run_folders() -> list[str]:
    return [name for name in os.listdir(tempfile.gettempdir()) if name.startswith("taas-run-")]


def ours(process: psutil.Process) -> bool:
    """Whether ``process`` was started from this test process (its temporary folder is in its environment):
    a test's cluster, its agents and ranks, orphans among them too."""
    try:
        return process.environ().get("TMPDIR") == os.environ["TMPDIR"]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def own_ray_of_environment() -> str:
    """``own_ray`` to the cluster of the kernel's $TAAS_CLUSTER."""
    return "import os\n" + _own_ray("os.environ['TAAS_CLUSTER']")


def leftovers(k: Kernel) -> str:
    """What a run may not leave: placement groups, run folders, processes of a run (seen from the kernel, whose
    own connection to Ray, beside its cluster driver's, goes to the cluster of its $TAAS_CLUSTER)."""
    groups = placement_groups(k)
    deadline = time.monotonic() + 3.0  # a run's supervisor is let go as it exits, not waited for
    while (processes := rank_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    found = {"placement groups": groups, "run folders": run_folders(), "rank processes": processes}
    return "; ".join(f"{what}: {items}" for what, items in found.items() if items)


def placement_groups(k: Kernel) -> list[str]:
    """The ids of the cluster's placement groups that are not removed (a run's, a session's and those its resizes
    added), as the kernel's own connection to Ray sees them."""
    k.execute(own_ray_of_environment()).ok()
    return k.value(
        "[g['placement_group_id'] for g in ray.util.placement_group_table().values() if g['state'] != 'REMOVED']"
    )


def node_agents() -> list[psutil.Process]:
    return [p for p in psutil.process_iter() if "NodeAgent" in " ".join(cmdline(p)) and ours(p)]


def raylets(addresses: list[str]) -> dict[str, psutil.Process]:
    """The raylets running of the test cluster's nodes at ``addresses``, by address (a removed node has none)."""
    found = {}
    for process in psutil.process_iter():
        words = cmdline(process)
        if process.name() == "raylet" and ours(process):
            found.update({a: process for a in addresses if any(w.endswith(f"node_ip_address={a}") for w in words)})
    return found


def raylet_of(address: str) -> psutil.Process:
    """The raylet of the test cluster's node at ``address`` (each node has a loopback address of its own)."""
    found = [
        p
        for p in psutil.process_iter()
        if p.name() == "raylet" and any(word.endswith(f"node_ip_address={address}") for word in cmdline(p)) and ours(p)
    ]
    assert len(found) == 1, f"raylets of {address}: {found}"
    return found[0]


def taas_on(raylet: psutil.Process) -> list[psutil.Process]:
    """taas's processes on a raylet's node: its agent (a worker the raylet started) and what the agent started,
    the fork server, a run's supervisor and ranks."""
    agents = [p for p in raylet.children() if "NodeAgent" in " ".join(cmdline(p))]
    return agents + [child for agent in agents for child in agent.children(recursive=True)]


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
            if (
                "taas_magic.launch.forkserver.server" in " ".join(cmdline(process))
                and process.parent().name().startswith("ray::")
                and ours(process)
            ):
                found += [p for p in process.children(recursive=True) if alive(p)]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, AttributeError):
            continue
    return found
