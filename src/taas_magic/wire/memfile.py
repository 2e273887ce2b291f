"""Tensors in anonymous memory files: written once with ``pwrite``, read back as views.

Both ways tensor data leaves a process without going through a pipe use this: the names a
spawned cell needs (``shipping.py``) and each element of a registered loader (``delivery``).
A pickle carries only where each tensor lies in the file; the receiver maps the file
copy-on-write (or, for a small file, reads it) and its tensors view that memory, which holds
no file descriptor.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

ALIGN = 64
READ_BELOW = 64 * 1024  # bytes: smaller files are copied into memory rather than mapped


_SEALS = ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE")


def new_file(name: str, size: int) -> int:
    """An anonymous memory file of ``size`` bytes (an unlinked temporary file where memfd is missing)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
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


def seal(fd: int) -> None:
    """Make the file's contents final: nobody, its writer included, can change or resize it from now on
    (where the system seals files; elsewhere nothing happens)."""
    import fcntl

    seals = [getattr(fcntl, name, None) for name in _SEALS]
    if hasattr(fcntl, "F_ADD_SEALS") and None not in seals:
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, sum(seals))  # type: ignore[arg-type]
        except OSError:
            pass  # not a memfd (the fallback's temporary file)


def sealed(fd: int) -> bool | None:
    """Whether ``seal`` made the file final; None where the system cannot seal it."""
    import fcntl

    seals = [getattr(fcntl, name, None) for name in _SEALS]
    if not hasattr(fcntl, "F_GET_SEALS") or None in seals:
        return None
    try:
        present = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return None
    wanted = sum(seals)  # type: ignore[arg-type]
    return present & wanted == wanted


def write_bytes(fd: int, data: bytes | memoryview, offset: int = 0) -> None:
    """All of ``data`` at ``offset``: one ``pwrite`` may write less than it was given (a large buffer, a
    signal on the way), and what it left out must not go missing."""
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written:], offset + written)


def read_bytes(fd: int, length: int, offset: int = 0) -> bytes:
    """``length`` bytes at ``offset``, or fewer only where the file ends first; one ``pread`` may return
    less than it was asked for."""
    pieces = []
    done = 0
    while done < length:
        piece = os.pread(fd, length - done, offset + done)
        if not piece:
            break
        pieces.append(piece)
        done += len(piece)
    return b"".join(pieces)


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def carries(tensor: Any) -> bool:
    """Whether a tensor is its elements and nothing more, so that a memory file can carry it: not quantized
    (its scale and zero point would be lost), sparse or otherwise laid out, nor holding attributes set on
    it (``t.note = …``), nor without data (``device="meta"``). Those go through torch's own pickling,
    which keeps what they carry."""
    import torch

    return (
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.device.type != "meta"
        and not tensor.__dict__
    )


def write_tensor(fd: int, tensor: Any, offset: int) -> None:
    """One copy, straight from the tensor's memory into the file: no mapping to fault in page by page."""
    import torch

    source = tensor.detach().resolve_conj().resolve_neg()  # the elements it shows, not their lazy negation
    if source.device.type != "cpu":
        source = source.cpu()
    if not source.numel():
        return
    data = source.contiguous().view(-1).view(torch.uint8).numpy()
    written = 0
    while written < data.nbytes:
        written += os.pwrite(fd, data[written:], offset + written)


def map_private(fd: int) -> Any:
    """The whole file as a flat uint8 tensor of the receiver's own: its changes stay its own.

    Nothing stays open: the caller may close ``fd`` at once. Python's ``mmap`` would keep a
    duplicate descriptor for as long as the mapping lives, so a rank that keeps a thousand
    delivered batches would run out of descriptors. Small files are read into memory (cheaper
    than a mapping, and no mapping to count against the process's limit); larger ones are
    mapped copy-on-write through ``/proc/self/fd``, whose descriptor torch closes once mapped.
    """
    import torch

    size = max(os.fstat(fd).st_size, 1)
    if size <= READ_BELOW:
        return _read_whole(fd, size)
    try:
        storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", False, size)
    except (RuntimeError, OSError):  # no /proc: a mapping that holds a descriptor of its own
        return torch.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]  # an UntypedStorage


def _read_whole(fd: int, size: int) -> Any:
    memory, _ = read_tensor(fd, 0, size)  # a file shorter than it said: the rest stays as it was
    return memory


def read_tensor(fd: int, offset: int, length: int) -> tuple[Any, int]:
    """``length`` bytes of the file from ``offset`` into a flat uint8 tensor of their own, read straight
    into it; and how many there were (fewer where the file ends first)."""
    import torch

    memory = torch.empty(length, dtype=torch.uint8)
    view = memoryview(memory.numpy())  # type: ignore[arg-type]  # a NumPy array is a buffer
    done = 0
    while done < length:
        read = os.preadv(fd, [view[done:]], offset + done)
        if not read:
            break
        done += read
    return memory, done


def tensor_view(memory: Any, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> Any:
    """A tensor over ``nbytes`` of ``memory`` (from ``map_private``) at ``offset``, without copying.

    Its storage is its own: it starts at the tensor's first byte and ends at its last (and keeps
    ``memory`` alive), as a tensor pickled alone would be, not a slice of the whole file. Some of
    torch's readers take a tensor's bytes from its storage's start: ``Generator.set_state`` read the
    wrong bytes of a generator's state shipped inside a ``DataLoader``, and crashed the process that
    unpickled it. And ``torch.save`` writes a tensor's whole storage: a slice of the file would
    write every other tensor in it.
    """
    import torch

    kind = getattr(torch, dtype)
    if not nbytes:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(memory.numpy(), dtype=kind, count=nbytes // kind.itemsize, offset=offset).view(shape)


def dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")
