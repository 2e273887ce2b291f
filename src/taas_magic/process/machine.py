"""What this machine offers: CPU cores and visible CUDA devices, found without touching CUDA.

The kernel must never initialize CUDA itself (a forked rank cannot use CUDA once the parent
has), so devices are counted through NVML or a short-lived subprocess, never through the
CUDA runtime in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache

from taas_magic import torch_private
from taas_magic.process import containment, kernel_debugger

GRPC_THREADS = {"event_engine", "lifeguard"}  # the names grpcio's own threads give themselves


@dataclass(frozen=True)
class Machine:
    cpus: int
    cuda_devices: int


def detect() -> Machine:
    return Machine(cpus=cpu_count(), cuda_devices=cuda_device_count())


def cpu_count() -> int:
    """Cores this process may run on (respects affinity masks and container CPU sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cuda_device_count() -> int:
    """CUDA devices visible to a rank, counted without initializing CUDA in this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    if sys.platform.startswith("linux") and not os.path.exists("/proc/driver/nvidia/gpus"):
        return 0  # no NVIDIA driver: nothing to ask
    return _count_with_nvml(visible)


@lru_cache(maxsize=4)
def _count_with_nvml(visible: str | None) -> int:
    try:
        import torch.cuda
    except ImportError:
        return 0
    count = torch_private.device_count_nvml(torch)  # NVML does not create a CUDA context
    if count is not None:
        return count
    probe = "import torch; print(torch.cuda.device_count())"
    try:
        with kernel_debugger.plain_subprocesses():
            out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def fork_poisoned_for_cuda() -> bool:
    """Whether a child forked now could not use CUDA.

    Not only an initialized CUDA context does that: ``torch.cuda.is_available()`` and
    ``device_count()`` in the kernel make every later fork unable to use CUDA, and nothing
    in the parent says so. A child forked for a few milliseconds asks torch itself.
    """
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(os, "fork"):
        return False
    if cuda_initialized_in_kernel():
        return True
    with containment.HeldInterrupts():  # the probe takes milliseconds: an interrupt waits for its end
        pid = kernel_debugger.fork()
        if pid == 0:
            try:
                os._exit(0 if torch_private.in_bad_fork(torch) is False else 1)  # not known: taken as unusable
            finally:
                os._exit(2)
        status = os.waitpid(pid, 0)[1]
    return os.waitstatus_to_exitcode(status) != 0


def grpc_threads_in_kernel() -> bool:
    """Whether Python's gRPC (``grpcio``: Ray Client, cloud SDKs) runs threads in this process.

    gRPC's fork handlers then restart those threads in every child before any of the child's
    code runs: forked ranks would carry them, and a child forked while one of them is in a call
    can die of SIGSEGV. A child started by ``exec`` (the fork server) is not touched.
    """
    if "grpc" not in sys.modules:
        return False
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return False
    for thread in threads:
        try:
            with open(f"/proc/self/task/{thread}/comm") as comm:
                if comm.read().strip() in GRPC_THREADS:
                    return True
        except OSError:
            pass
    return False


def cuda_initialized_in_kernel() -> bool:
    """Whether CUDA is initialized in this process, which makes forking ranks unsafe: torch says so, or the
    CUDA driver was initialized by another way (a library's ``cuInit``), which torch does not see."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        if torch.cuda.is_initialized():
            return True
    except Exception:
        pass
    return cuda_driver_open()


def cuda_driver_open(descriptors: str = "/proc/self/fd", device: str = "/dev/nvidia-uvm") -> bool:
    """Whether this process holds the CUDA driver's unified-memory ``device`` open, as ``cuInit`` leaves it
    (NVML, which the live view reads, does not open it): a child forked now gets "initialization error".
    Asked before every cell: where the device does not exist (no NVIDIA driver) one look at it answers."""
    if not os.path.exists(device):
        return False
    try:
        names = os.listdir(descriptors)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(os.path.join(descriptors, name)).startswith(device):
                return True
        except OSError:
            continue  # closed meanwhile
    return False
