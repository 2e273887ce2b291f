"""The data of tensors and NumPy arrays beside a pickle, not in it: what a cell sends back moves at memory speed.

A pickle of a tensor holds a copy of its storage, made by torch's own serializer, and every hop
on the way (a pipe, a message, the kernel's read) copies it again: about 90 MB/s for an 800 MB
result. Here the pickler writes, in place of each tensor or array, where its elements lie in the
rank's memory; the memory they cover is copied once, into the file the kernel maps, and rebuilt
there as views of that map. Addresses, not objects, decide what is written: tensors and arrays
that share memory (a tensor and its ``.numpy()``, a model's tied weights, two views of one
storage) are written once and share it again in the kernel, and a small view of a large storage
(``big[:3]``) carries only the bytes it covers.

Each range keeps its position modulo ``ALIGN`` in the file, so every element stays as aligned
as it was in the rank.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from taas_magic.wire import beside, memfile

ALIGN = memfile.ALIGN  # each range keeps its place modulo this, as memory files align their tensors


@dataclass(frozen=True)
class Span:
    """Memory of the rank written into the file: bytes ``[start, end)`` of the rank's address space at
    ``offset`` in the file."""

    start: int
    end: int
    offset: int


@dataclass(frozen=True)
class _Member:
    """One tensor or array sent beside the pickle: the bytes it covers, and the bytes its elements take."""

    start: int
    end: int
    used: int
    obj: Any


@dataclass
class Layout:
    """Where a pickle's tensors and arrays lie in the file: the spans of memory written, and the members
    written compact (a copy of their elements, at the copy's address, laid out contiguous), by the address
    the pickle names them by."""

    spans: list[Span]
    compacted: dict[int, int]


@dataclass
class Collector:
    """What a pickler found to send beside the pickle, and the objects that own that memory (kept alive,
    so the addresses stay theirs until the file is written)."""

    members: list[_Member] = field(default_factory=list)
    copies: list[Any] = field(default_factory=list)

    def reduce(self, obj: Any) -> tuple[Any, tuple[Any, ...]] | None:
        """The reduction that sends ``obj`` beside the pickle; None for what goes in it as usual."""
        found = _tensor_layout(obj) or _array_layout(obj)
        if found is None:
            return None
        rebuild, args, (start, end), used = found
        if end > start:
            self.members.append(_Member(start, end, used, obj))
        return rebuild, args

    def layout(self) -> Layout:
        """The members' memory merged where it overlaps, placed in the file from its start (aligned) on. A
        member alone in memory it covers sparsely (a column of a large matrix, ``big[:3]``) is written as
        a compact copy of its elements instead: less than half of the memory, and a megabyte or more left out."""
        groups: list[list[_Member]] = []
        for member in sorted(self.members, key=lambda m: m.start):
            if groups and member.start < max(m.end for m in groups[-1]):
                groups[-1].append(member)
            else:
                groups.append([member])
        ranges, compacted = [], {}
        for group in groups:
            start, end = group[0].start, max(m.end for m in group)
            alone = len({id(m.obj) for m in group}) == 1
            if alone and end - start > 2 * group[0].used and end - start - group[0].used >= SPARSE_BYTES:
                copy = _compact(group[0].obj)
                self.copies.append(copy)
                address = _address(copy)
                compacted[_address(group[0].obj)] = address
                ranges.append((address, address + group[0].used))
            else:
                ranges.append((start, end))
        spans, offset = [], 0
        for start, end in sorted(ranges):
            offset = _placed(offset, start)
            spans.append(Span(start, end, offset))
            offset += end - start
        return Layout(spans, compacted)


SPARSE_BYTES = 1 << 20


def _compact(obj: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.detach().clone(memory_format=torch.contiguous_format)
    import numpy

    return numpy.ascontiguousarray(obj)


def _address(obj: Any) -> int:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return int(obj.data_ptr())
    return int(obj.__array_interface__["data"][0])


def _placed(offset: int, address: int) -> int:
    """The first offset from ``offset`` on that is congruent to ``address`` modulo ``ALIGN``."""
    return offset + (address - offset) % ALIGN


def write(fd: int, spans: list[Span]) -> None:
    """Each span's memory into ``fd``, straight from where it lies: one copy."""
    for span in spans:
        length = span.end - span.start
        view = memoryview((ctypes.c_ubyte * length).from_address(span.start)).cast("B")
        written = 0
        while written < length:
            written += os.pwrite(fd, view[written:], span.offset + written)


def copy_into(buffer: bytearray, spans: list[Span]) -> None:
    """Each span's memory into ``buffer`` (a result small enough to travel in its message)."""
    for span in spans:
        buffer[span.offset : span.offset + span.end - span.start] = ctypes.string_at(span.start, span.end - span.start)


# -- what is sent beside the pickle ---------------------------------------------------------------
def _tensor_layout(obj: Any) -> tuple[Any, tuple[Any, ...], tuple[int, int], int] | None:
    torch = sys.modules.get("torch")
    if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_quantized or obj.__dict__:
        return None  # torch's own pickling: what it carries besides the elements, or a device's
    if obj.is_conj() or obj.is_neg() or obj.data_ptr() % obj.element_size():
        return None
    start, end = _extent(obj.data_ptr(), obj.shape, obj.stride(), obj.element_size())
    flags = (bool(obj.requires_grad), isinstance(obj, torch.nn.Parameter))
    args = (obj.data_ptr(), str(obj.dtype).removeprefix("torch."), tuple(obj.shape), tuple(obj.stride()), *flags)
    return _tensor, args, (start, end), obj.numel() * obj.element_size()


def _array_layout(obj: Any) -> tuple[Any, tuple[Any, ...], tuple[int, int], int] | None:
    numpy = sys.modules.get("numpy")
    if numpy is None or type(obj) is not numpy.ndarray or obj.dtype.hasobject:
        return None
    address = obj.__array_interface__["data"][0]
    elements = [s // obj.itemsize if obj.itemsize else 0 for s in obj.strides]
    if obj.itemsize == 0 or any(s % obj.itemsize for s in obj.strides):
        return None  # a stride that is not a whole element: NumPy's own pickling
    start, end = _extent(address, obj.shape, elements, obj.itemsize)
    writeable = bool(obj.flags.writeable)
    return _array, (address, obj.dtype, tuple(obj.shape), tuple(obj.strides), writeable), (start, end), obj.nbytes


def _extent(address: int, shape: Any, strides: Any, item: int) -> tuple[int, int]:
    """The bytes ``[start, end)`` the elements of a strided layout cover (negative strides too)."""
    if any(size == 0 for size in shape):
        return address, address
    low = sum((size - 1) * stride for size, stride in zip(shape, strides) if stride < 0)
    high = sum((size - 1) * stride for size, stride in zip(shape, strides) if stride > 0)
    return address + low * item, address + (high + 1) * item


# -- in the kernel --------------------------------------------------------------------------------
MAP_FROM = 1 << 20  # bytes: a span this large is mapped from the file; a smaller one is read into memory


class Reader:
    """Each span's memory (a flat uint8 tensor of its own, in the order of ``layout.spans``): what the
    rebuilt tensors and arrays view. A span's memory starts at its first address rounded down to
    ``ALIGN``, so every element keeps its alignment; it holds nothing of other spans' names, so a
    tensor's storage is only the memory it shared in the rank (``torch.save`` of it writes no more)."""

    def __init__(self, layout: Layout, memory: list[Any]):
        self.spans = layout.spans
        self.compacted = layout.compacted
        self.memory = memory
        self._starts = [span.start for span in self.spans]

    def rebuild(self, name: str) -> Callable[..., Any] | None:
        """The rebuild function a pickle names (``beside.Unpickling``): this reader's own."""
        rebuilds: dict[str, Callable[..., Any]] = {"_tensor": self.tensor, "_array": self.array}
        return rebuilds.get(name)

    def place(
        self, address: int, strides: tuple[int, ...], contiguous: tuple[int, ...]
    ) -> tuple[Any, int, tuple[int, ...]]:
        """The memory of the member the pickle names by ``address``, where it starts in it, and its strides."""
        moved = self.compacted.get(address)
        found = address if moved is None else moved
        index = bisect.bisect_right(self._starts, found) - 1
        start = self.spans[index].start - self.spans[index].start % ALIGN
        return self.memory[index], found - start, strides if moved is None else contiguous

    def tensor(
        self, address: int, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...], grad: bool, param: bool
    ) -> Any:
        """A tensor of the rank, a view of the memory it came in."""
        import torch

        kind = getattr(torch, dtype)
        if 0 in shape:
            tensor = torch.empty(shape, dtype=kind)
        else:
            memory, offset, stride = self.place(address, stride, _contiguous(shape, 1))
            item = torch.empty((), dtype=kind).element_size()
            tensor = torch.empty(0, dtype=kind).set_(memory.untyped_storage(), offset // item, shape, stride)
        if param:
            return torch.nn.Parameter(tensor, requires_grad=grad)
        return tensor.requires_grad_() if grad else tensor

    def array(self, address: int, dtype: Any, shape: tuple[int, ...], strides: tuple[int, ...], writeable: bool) -> Any:
        """A NumPy array of the rank, a view of the memory it came in."""
        import numpy

        if 0 in shape:
            return numpy.empty(shape, dtype=dtype)
        memory, offset, strides = self.place(address, strides, _contiguous(shape, numpy.dtype(dtype).itemsize))
        array = numpy.ndarray(shape, dtype=dtype, buffer=memory.numpy(), offset=offset, strides=strides)
        array.flags.writeable = writeable
        return array


@beside.placeholder
def _tensor(address: int, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...], grad: bool, param: bool) -> Any:
    """A tensor the pickle names by its address in the rank (``Reader.tensor``)."""


@beside.placeholder
def _array(address: int, dtype: Any, shape: tuple[int, ...], strides: tuple[int, ...], writeable: bool) -> Any:
    """A NumPy array the pickle names by its address in the rank (``Reader.array``)."""


def file_range(span: Span) -> tuple[int, int]:
    """Where a span's memory lies in the file: from its first address rounded down to ``ALIGN``."""
    lead = span.start % ALIGN
    return span.offset - lead, span.end - span.start + lead


def read_span(fd: int, span: Span) -> Any:
    """A span's memory from the file: mapped copy-on-write where it is large, read where it is small."""
    import torch

    offset, length = file_range(span)
    if length >= MAP_FROM:
        return torch.frombuffer(_Mapped.of(fd, offset, length), dtype=torch.uint8)
    memory, done = memfile.read_tensor(fd, offset, length)
    if done < length:
        raise EOFError(f"the names' file ends {length - done} bytes early")
    return memory


def copy_span(data: bytes | bytearray | memoryview, span: Span) -> Any:
    """A span's memory from the names' bytes, as a tensor of its own."""
    import torch

    offset, length = file_range(span)
    return torch.frombuffer(bytearray(data[offset : offset + length]), dtype=torch.uint8)


class _Mapped:
    """A private mapping of part of a file, unmapped when the last tensor that views it is gone: it holds
    no descriptor (Python's ``mmap`` keeps one per mapping, and a large model has hundreds of spans)."""

    def __init__(self, address: int, length: int):
        self.address, self.length = address, length

    @classmethod
    def of(cls, fd: int, offset: int, length: int) -> Any:
        import mmap

        page = offset - offset % mmap.PAGESIZE
        total = length + offset - page
        address = _libc().mmap(None, total, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, page)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"could not map {total} bytes of the names' file")
        buffer = (ctypes.c_ubyte * length).from_address(address + offset - page)
        buffer._mapping = cls(address, total)  # type: ignore[attr-defined]  # unmapped with the buffer
        return buffer

    def __del__(self) -> None:
        _libc().munmap(self.address, self.length)


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _LIBC = libc
    return _LIBC


def _contiguous(shape: tuple[int, ...], item: int) -> tuple[int, ...]:
    """Row-major strides of ``shape``, in units of ``item``."""
    strides, step = [], item
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
