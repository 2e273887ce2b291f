"""Tensors in anonymous memory files: written once with ``pwrite``, read back as views.

Both ways tensor data leaves a process without going through a pipe use this: the names a
spawned cell needs (``shipping.py``) and each element of a registered loader (``delivery``).
A pickle carries only where each tensor lies in the file; the receiver maps the file
copy-on-write and its tensors view that mapping, so nothing is copied on its side.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

ALIGN = 64


def new_file(name: str, size: int) -> int:
    """An anonymous memory file of ``size`` bytes (an unlinked temporary file where memfd is missing)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    else:
        import tempfile

        fd, path = tempfile.mkstemp(prefix=f"{name}-")
        os.unlink(path)
    try:
        os.ftruncate(fd, max(size, 1))
    except BaseException:
        os.close(fd)
        raise
    return fd


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def write_tensor(fd: int, tensor: Any, offset: int) -> None:
    """One copy, straight from the tensor's memory into the file: no mapping to fault in page by page."""
    import torch

    source = tensor.detach()
    if source.device.type != "cpu":
        source = source.cpu()
    if not source.numel():
        return
    data = source.contiguous().view(-1).view(torch.uint8).numpy()
    written = 0
    while written < data.nbytes:
        written += os.pwrite(fd, data[written:], offset + written)


def map_private(fd: int) -> mmap.mmap:
    """The whole file, mapped copy-on-write: the receiver's changes stay its own."""
    return mmap.mmap(fd, max(os.fstat(fd).st_size, 1), access=mmap.ACCESS_COPY)


def tensor_view(memory: mmap.mmap, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> Any:
    """A tensor over ``nbytes`` of ``memory`` at ``offset``, without copying."""
    import torch

    kind = getattr(torch, dtype)
    if not nbytes:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=offset).view(kind).view(shape)


def dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")
