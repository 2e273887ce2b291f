"""How a cell's ranks start on this machine: forked from the kernel where that is safe, else from the fork server.

``header/spec.py``'s ``resolve_start`` decides, from what this module reads of the kernel as the cell starts: whether
CUDA was used here, whether a fork would poison CUDA in GPU ranks, whether gRPC runs threads here, how many runs go
on in the background.
"""

from __future__ import annotations

import os
import sys
from typing import Literal

from taas_magic.kernel.header.spec import LaunchSpec, resolve_start
from taas_magic.process import machine


def choose(spec: LaunchSpec, in_background: int) -> Literal["fork", "forkserver"]:
    """Fork when it is safe, else the fork server; why not fork, in one line to the cell, where ``auto`` chose."""
    can_fork = hasattr(os, "fork")
    # An initialized CUDA context makes any fork risky; a poisoned fork matters to GPU ranks only.
    unsafe = machine.cuda_initialized_in_kernel() or (
        spec.device == "cuda" and can_fork and machine.fork_poisoned_for_cuda()
    )
    start, notice = resolve_start(
        spec.start,
        spec.device,
        unsafe,
        can_fork,
        grpc_threads=can_fork and machine.grpc_threads_in_kernel(),
        in_background=in_background,
    )
    if notice:
        print(notice, file=sys.stderr)
    return start
