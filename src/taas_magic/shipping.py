"""Shipping what a cell needs from the kernel's namespace to ranks that do not share its memory.

Only the names the cell reads are shipped; cloudpickle follows the functions it uses to the
globals they read. All of it goes in one pickle, so every shipped function shares one globals
dict in the ranks — the cell runs in that dict, and functions see the names the cell binds, as
in the kernel. Tensor data does not go through the pickle: it is copied once into an
anonymous memory file (memfd) that the ranks map copy-on-write, so N ranks cost one copy.

A name the cell needs that cannot be pickled (a lock, an open file, a generator…) fails the
cell before anything starts, naming the variable; an unneeded one is never looked at.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import sys
import types
from dataclasses import dataclass
from typing import Any, Collection

import cloudpickle

from . import memfile
from .errors import TaasUsageError, first_line

ANCHOR = "__taas_globals_anchor__"


def needed_names(reads: Collection[str], namespace: dict[str, Any]) -> list[str]:
    """Names the cell reads that the kernel's namespace holds (builtins and IPython's own excluded)."""
    hidden = _ipython_names(namespace)
    return sorted(name for name in reads if name in namespace and name not in hidden)


def _ipython_names(namespace: dict[str, Any]) -> set[str]:
    return {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_ih", "_oh", "_dh", "_i", "_ii", "_iii"}


@dataclass
class Shipment:
    """One pickle for all ranks, and the memory file holding its tensors' data."""

    data: bytes
    tensors_fd: int | None  # memfd with every tensor's bytes; the receiver maps it
    tensors_size: int

    def close(self) -> None:
        if self.tensors_fd is not None:
            os.close(self.tensors_fd)
            self.tensors_fd = None


@dataclass(frozen=True)
class _TensorRef:
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool
    parameter: bool


class _ShippingPickler(cloudpickle.Pickler):
    """Pickles tensors as references into one memory file instead of by value."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Any] = []
        self.size = 0

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
            if obj.is_sparse or obj.layout != torch.strided or obj.dtype in (torch.complex32,):
                return super().reducer_override(obj)
            nbytes = obj.numel() * obj.element_size()
            offset = memfile.aligned(self.size)
            self.tensors.append((offset, obj))
            self.size = offset + nbytes
            ref = _TensorRef(offset, nbytes, memfile.dtype_name(obj), tuple(obj.shape),
                             obj.requires_grad, isinstance(obj, torch.nn.Parameter))
            return _rebuild_tensor, (ref,)
        return super().reducer_override(obj)


def pack(namespace: dict[str, Any], names: list[str], to: str = "ranks started with --start forkserver") -> Shipment:
    """Pickle ``names`` from ``namespace`` for the ranks; raises TaasUsageError naming what cannot go."""
    for name in names:
        _check_shippable(name, namespace[name], to)
    anchor = types.FunctionType(compile("None", "<taas>", "eval"), namespace)
    buffer = io.BytesIO()
    pickler = _ShippingPickler(buffer)
    pickler.dump({ANCHOR: anchor, **{name: namespace[name] for name in names}})
    fd = _write_tensors(pickler.tensors, pickler.size) if pickler.tensors else None
    return Shipment(buffer.getvalue(), fd, pickler.size)


def _check_shippable(name: str, value: Any, to: str) -> None:
    try:
        _ShippingPickler(io.BytesIO()).dump(value)
    except Exception as e:
        raise TaasUsageError(
            f"the cell needs {name!r} (a {type(value).__module__}.{type(value).__qualname__}), which cannot be "
            f"sent to {to} ({first_line(e)}): create it inside the cell"
        ) from e


def _write_tensors(tensors: list[tuple[int, Any]], size: int) -> int:
    """Copy every tensor's bytes into one anonymous memory file (the one extra copy)."""
    fd = memfile.new_file("taas-tensors", size)
    try:
        for offset, tensor in tensors:
            memfile.write_tensor(fd, tensor, offset)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- in the receiving process ---------------------------------------------------------------
_mapped: mmap.mmap | None = None


def unpack(data: bytes, tensors_fd: int | None, tensors_size: int) -> dict[str, Any]:
    """The namespace the cell runs in: the shipped names in the globals dict their functions share.

    Runs in the fork server, which must never touch CUDA: tensors that lived on a GPU in the
    kernel arrive on the CPU, and the cell moves them (``.to(taas.device())``) as it would anyway.
    """
    global _mapped
    if tensors_fd is not None:
        _mapped = memfile.map_private(tensors_fd)
    try:
        shipped: dict[str, Any] = pickle.loads(data)
    finally:
        _mapped = None
    namespace: dict[str, Any] = shipped.pop(ANCHOR).__globals__
    namespace.update(shipped)
    namespace["__name__"] = "__main__"
    return namespace


def _rebuild_tensor(ref: _TensorRef) -> Any:
    import torch

    if _mapped is None:
        raise RuntimeError("a shipped tensor can only be unpickled by shipping.unpack, with its memory file")
    tensor = memfile.tensor_view(_mapped, ref.offset, ref.nbytes, ref.dtype, ref.shape)
    if ref.parameter:
        return torch.nn.Parameter(tensor, requires_grad=ref.requires_grad)
    return tensor.requires_grad_(ref.requires_grad) if ref.requires_grad else tensor
