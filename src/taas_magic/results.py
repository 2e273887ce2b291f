"""Results back: the names a cell binds at top level in rank 0 come back into the notebook.

Rank 0 pickles them in one go (so objects that share parts, like a model and its optimizer,
still share them) with CUDA tensors turned into CPU tensors and DDP wrappers into the module
they wrap: unpickling in the kernel must never initialize CUDA there. What cannot be pickled
is left out by name, with the reason, instead of failing a run that succeeded.
"""

from __future__ import annotations

import io
import pickle
import types
from typing import Any, Iterable

import cloudpickle

from .errors import first_line


class _ResultPickler(cloudpickle.Pickler):
    """A cloudpickle pickler that sends tensors as CPU tensors and DDP wrappers as their module."""

    def reducer_override(self, obj: Any) -> Any:
        converted = _portable(obj)
        if converted is not obj:
            return _same, (converted,)
        return super().reducer_override(obj)


def _same(value: Any) -> Any:
    return value


def _portable(obj: Any) -> Any:
    torch = _torch()
    if torch is None:
        return obj
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        return obj.module
    if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
        cpu = obj.detach().cpu()
        return torch.nn.Parameter(cpu, requires_grad=obj.requires_grad) if isinstance(obj, torch.nn.Parameter) else cpu
    return obj


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")


def dumps(values: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """Pickle what can be pickled; returns the pickle and {name: why} for what was left out."""
    skipped: dict[str, str] = {}
    for name, value in values.items():
        why = _why_not_sendable(value)
        if why:
            skipped[name] = why
    kept = {name: value for name, value in values.items() if name not in skipped}
    try:
        return _dump(kept), skipped
    except Exception:
        pass  # something fails only in combination: find it name by name
    for name, value in kept.items():
        try:
            _dump({name: value})
        except Exception as e:
            skipped[name] = f"{type(value).__name__} cannot be pickled ({first_line(e)})"
    kept = {name: value for name, value in kept.items() if name not in skipped}
    return _dump(kept), skipped


def _dump(values: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    _ResultPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(values)
    return buffer.getvalue()


def _why_not_sendable(value: Any) -> str | None:
    """Objects that only make sense inside the job, named before pickling is even tried."""
    torch = _torch()
    if isinstance(value, types.ModuleType):
        return None
    if torch is not None:
        if isinstance(value, torch.utils.data.dataloader._BaseDataLoaderIter):
            return "DataLoader iterator (exists only inside the job)"
        if isinstance(value, torch.utils.data.DataLoader):
            iterator = getattr(value, "_iterator", None)
            if iterator is not None and getattr(iterator, "_workers", None):
                return "DataLoader with live worker processes"
        distributed = getattr(torch, "distributed", None)
        process_group = getattr(distributed, "ProcessGroup", None) if distributed else None
        if process_group is not None and isinstance(value, process_group):
            return "process group (exists only inside the job)"
    return None


def loads(data: bytes) -> dict[str, Any]:
    return pickle.loads(data)


def wanted(bound: Iterable[str], requested: tuple[str, ...] | None) -> tuple[str, ...]:
    """The names to send back: all bound names, or those ``--return`` asked for."""
    if requested is None:
        return tuple(name for name in bound if not name.startswith("_"))
    return requested
