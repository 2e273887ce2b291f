"""torch's private functions that taas uses, each behind one function here, where no public one does the job.

A torch release that moves or drops one fails ``tests/unit/process/test_torch_private.py``, which names
torch's version and the function; each caller has a way on without it, so a user's run goes on:

- ``torch.cuda._device_count_nvml``: the GPUs NVML sees, without creating a CUDA context (the public
  ``device_count`` may make later forks unable to use CUDA). Without it: a subprocess counts them.
- ``torch._C._cuda_isInBadFork``: whether a forked child could use CUDA; torch has no public question.
  Without it: "not known", and the kernel then judges by what it knows itself.
- ``torch._C._distributed_c10d._dump_fr_trace`` and ``_dump_nccl_trace``: the flight recorder's rings of
  collectives, read in the rank (the public way writes files on a signal). Without them: the hang
  doctor sees no collective, and says where each rank is by its stack alone.
"""

from __future__ import annotations

from typing import Any, Callable

FLIGHT_RECORDER_DUMPS = ("_dump_fr_trace", "_dump_nccl_trace")  # every backend's ring; NCCL's own ring


def device_count_nvml(torch: Any) -> int | None:
    """The GPUs NVML sees (None: not known, this torch lacks the function or NVML failed)."""
    count = getattr(torch.cuda, "_device_count_nvml", None)
    if count is None:
        return None
    try:
        found = int(count())
    except Exception:  # no NVML library, no driver
        return None
    return found if found >= 0 else None


def in_bad_fork(torch: Any) -> bool | None:
    """In a forked child: whether CUDA is unusable here (None: this torch cannot say)."""
    ask = getattr(torch._C, "_cuda_isInBadFork", None)
    return None if ask is None else bool(ask())


def flight_recorder_dumps() -> list[Callable[[bool, bool, bool], bytes]]:
    """The flight recorder's readers this torch has: each ``(entries, stacks, only_active)`` -> a pickle."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:  # a build without torch.distributed
        return []
    return [reader for reader in (getattr(c10d, name, None) for name in FLIGHT_RECORDER_DUMPS) if reader is not None]


def missing(torch: Any) -> list[str]:
    """The private functions of this module that ``torch`` lacks."""
    absent = [] if hasattr(torch.cuda, "_device_count_nvml") else ["torch.cuda._device_count_nvml"]
    absent += [] if hasattr(torch._C, "_cuda_isInBadFork") else ["torch._C._cuda_isInBadFork"]
    if not flight_recorder_dumps():
        absent.append("torch._C._distributed_c10d." + " and ".join(FLIGHT_RECORDER_DUMPS))
    return absent
