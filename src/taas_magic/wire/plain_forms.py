"""Sharded tensors and the modules holding them, written as the plain ones a notebook uses on CPU.

A DTensor goes as its full tensor, which the ranks gathered at the end of the cell (``rank/sharded.py``,
through ``Whole``); a module that FSDP2 or tensor parallelism changed goes as a module of its own class,
without their state and hooks, which need the job's ranks. The pickler of names back (``results.py``)
asks this first for every object. It lives apart because it follows torch.distributed's internals (the
module hook tables of ``torch_private``), which change with torch, while the format of names back does not.
"""

from __future__ import annotations

import pickle
from typing import Any, Mapping, Protocol

from taas_magic import torch_private
from taas_magic.wire import pickler


class Whole(Protocol):
    """The full values of the sharded tensors (DTensors) among the names, gathered by the ranks before
    pickling (``rank/sharded.py``)."""

    def full(self, sharded: Any) -> Any | None:
        """The full CPU tensor of ``sharded``; None where it was not gathered."""

    def sharded_parameters(self, module: Any) -> Mapping[str, Any]:
        """{name: sharded parameter} to write in place of what ``module`` holds now (FSDP's unsharded forms)."""


class NotGathered(pickle.PicklingError):
    """A DTensor that the ranks did not gather: where ``rank/sharded.py`` does not look, or pickled without it."""


_HOOKS = torch_private.MODULE_HOOKS
_HOOK_TABLES = torch_private.MODULE_HOOK_TABLES
_PARALLEL_STATE = torch_private.FSDP_MODULE_MARKS
_COMPOSABLE_STATE = torch_private.COMPOSABLE_STATE_PREFIX


class PlainForms:
    """How DTensors and the modules that hold them are written: as the plain tensors and modules a
    notebook uses on CPU. The ranks' live objects are only read, never changed."""

    def __init__(self, torch: Any, dtensor: type, fsdp_module: type | None):
        self.torch, self.dtensor, self.fsdp_module = torch, dtensor, fsdp_module

    @classmethod
    def find(cls) -> PlainForms | None:
        import sys

        tensors = sys.modules.get("torch.distributed.tensor")
        if tensors is None:
            return None
        fsdp = sys.modules.get("torch.distributed.fsdp")
        return cls(sys.modules["torch"], tensors.DTensor, getattr(fsdp, "FSDPModule", None))

    def reduce(self, obj: Any, whole: Whole | None) -> Any:
        if isinstance(obj, self.dtensor):
            return pickler.same, (self._full(obj, whole),)
        if isinstance(obj, self.torch.nn.Module) and not isinstance(
            obj, self.torch.nn.parallel.DistributedDataParallel
        ):
            return self._plain_module(obj, whole.sharded_parameters(obj) if whole is not None else {})
        return None

    def _full(self, obj: Any, whole: Whole | None) -> Any:
        full = whole.full(obj) if whole is not None else None
        if full is None:
            raise NotGathered(
                "holds a sharded tensor (DTensor) that taas gathers only as a name, in a module, "
                "an optimizer, or a dict, list or tuple of these"
            )
        if isinstance(obj, self.torch.nn.Parameter):
            return self.torch.nn.Parameter(full, requires_grad=obj.requires_grad)
        return full.requires_grad_(obj.requires_grad) if obj.requires_grad and full.is_floating_point() else full

    def _plain_module(self, module: Any, sharded: Mapping[str, Any]) -> Any:
        """(a new ``cls`` object, its state) for a module that FSDP2 or tensor parallelism changed: of its
        own class again, without their state and hooks, with ``sharded`` parameters in place of those FSDP
        holds unsharded now; None for any other module."""
        cls = type(module)
        if self.fsdp_module is not None and isinstance(module, self.fsdp_module):
            cls = next(base for base in cls.__mro__ if not issubclass(base, self.fsdp_module))
        state = module.__dict__
        dropped = {key for key in state if key in _PARALLEL_STATE or key.startswith(_COMPOSABLE_STATE)}
        hooks = {
            key: [handle for handle, hook in state[key].items() if _parallel_hook(hook)]
            for key in _HOOKS
            if isinstance(state.get(key), dict)
        }
        hooks = {key: handles for key, handles in hooks.items() if handles}
        if cls is type(module) and not dropped and not hooks and not sharded:
            return None
        plain = {key: value for key, value in state.items() if key not in dropped}
        if sharded:
            plain["_parameters"] = {name: sharded.get(name, value) for name, value in state["_parameters"].items()}
        for key, handles in hooks.items():
            plain[key] = type(state[key])(
                (handle, hook) for handle, hook in state[key].items() if handle not in handles
            )
        gone = {handle for handles in hooks.values() for handle in handles}
        for key in _HOOK_TABLES:
            table = state.get(key)
            if isinstance(table, dict) and gone & set(table):
                plain[key] = type(table)((handle, flag) for handle, flag in table.items() if handle not in gone)
        return _new_module, (cls,), plain


def _parallel_hook(hook: Any) -> bool:
    """A hook that torch.distributed put on a module (FSDP's, tensor parallelism's): it needs the job's ranks."""
    function = getattr(hook, "func", hook)  # functools.partial
    function = getattr(function, "__func__", function)  # a bound method
    return str(getattr(function, "__module__", "") or "").startswith("torch.distributed.")


def _new_module(cls: Any) -> Any:
    """A module of ``cls``, its state still to come (pickle's BUILD calls ``Module.__setstate__``)."""
    return cls.__new__(cls)
