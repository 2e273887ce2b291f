"""Tensor data beside a pickle, not in it: how every hop of taas (kernel to ranks, producer to rank, ranks to
kernel) moves tensors at memory speed.

The pickler pickles, in a tensor's place, a call to a rebuild function with where its elements lie; the
elements travel in a file of their own, and the receiver rebuilds each tensor as a view of that file's memory.
The rebuild functions a pickle names are placeholders: the unpickler (``Unpickling``) resolves each name to a
method of the reader it was given, which holds that file's memory. Nothing is kept in a module's globals, so
two reads at once (two threads, or one rank reading an element while it unpacks a cell) never see each
other's memory, and a pickle unpickled without its file fails in one line.

Two layouts of the file exist: ``FileTensors`` here lays whole tensors one after another in a new memory file
(the kernel's names for ranks, a producer's element for a rank); ``bulk.py`` writes the spans of a rank's
memory that its tensors and arrays cover (what a cell sends back), keeping what shares memory shared.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any, Callable, Protocol, TypeVar, cast

from taas_magic.wire import memfile


class Reader(Protocol):
    """What rebuilds the tensors of one pickle: the rebuild function a pickle names, by that name."""

    def rebuild(self, name: str) -> Callable[..., Any] | None: ...


class Unpickling:
    """Mixed into an unpickler: the placeholders ``placeholder`` made, found by the pickle's global lookups, are
    the reader's own functions. Placed before ``pickle.Unpickler`` (or ``pickle._Unpickler``) in the bases."""

    def __init__(self, file: Any, reader: Reader, *args: Any, **kwargs: Any):
        super().__init__(file, *args, **kwargs)  # type: ignore[call-arg]
        self.reader = reader

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)  # type: ignore[misc]
        rebuild = getattr(found, _PLACEHOLDER, None)
        if rebuild is None:
            return found
        own = self.reader.rebuild(rebuild)
        if own is None:
            raise pickle.UnpicklingError(f"this pickle's {name} was sent beside it in a file of another kind")
        return own


class Unpickler(Unpickling, pickle.Unpickler):
    """The usual (C) unpickler, reading tensors beside the pickle through ``reader``."""


_PLACEHOLDER = "__taas_rebuilt_by__"
Function = TypeVar("Function", bound=Callable[..., Any])


def placeholder(function: Function) -> Function:
    """Makes a module-level function a name for a pickle to call in a tensor's place: an ``Unpickling``
    unpickler calls its reader's ``rebuild(name)`` instead, with the same arguments. Called itself (by a
    plain ``pickle.loads``), it says what is missing."""

    @functools.wraps(function)
    def unreadable(*args: Any, **kwargs: Any) -> Any:
        raise pickle.UnpicklingError(
            "a tensor sent beside its pickle can only be unpickled by taas, with the file its elements came in"
        )

    setattr(unreadable, _PLACEHOLDER, function.__name__)
    return cast(Function, unreadable)


@placeholder
def tensor_at(
    offset: int, nbytes: int, dtype: str, shape: tuple[int, ...], requires_grad: bool, parameter: bool
) -> Any:
    """A tensor of ``FileTensors``: ``nbytes`` at ``offset`` in the file's tensor data (``FileReader``)."""


class FileTensors:
    """The tensors a pickler met, laid one after another (each aligned) for one new memory file; the
    pickle holds, in each one's place, ``tensor_at`` with where it lies and what it is."""

    def __init__(self) -> None:
        self.tensors: list[tuple[int, Any]] = []
        self.size = 0

    def reduce(self, tensor: Any, parameter: bool = False) -> tuple[Any, tuple[Any, ...]]:
        """The reduction that sends ``tensor`` (whose elements ``memfile.carries``) beside the pickle."""
        nbytes = tensor.numel() * tensor.element_size()
        offset = memfile.aligned(self.size)
        self.tensors.append((offset, tensor))
        self.size = offset + nbytes
        where = (offset, nbytes, memfile.dtype_name(tensor), tuple(tensor.shape), bool(tensor.requires_grad), parameter)
        return tensor_at, where

    def write(self, fd: int, start: int = 0) -> None:
        """Every tensor's elements into ``fd``, the first at ``start``: one copy each."""
        for offset, tensor in self.tensors:
            memfile.write_tensor(fd, tensor, start + offset)


class FileReader:
    """Rebuilds ``FileTensors``' tensors as views of the file's memory (``memfile.map_private``), whose tensor
    data begins at ``start``."""

    def __init__(self, memory: Any, start: int = 0):
        self.memory = memory
        self.start = start

    def rebuild(self, name: str) -> Callable[..., Any] | None:
        return self.tensor_at if name == "tensor_at" else None

    def tensor_at(
        self, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...], requires_grad: bool, parameter: bool
    ) -> Any:
        tensor = memfile.tensor_view(self.memory, self.start + offset, nbytes, dtype, shape)
        if parameter:
            import torch

            return torch.nn.Parameter(tensor, requires_grad=requires_grad)
        return tensor.requires_grad_() if requires_grad else tensor


def on_cpu(tensor: Any) -> Any:
    """A copy on the CPU of a tensor on a device, that keeps what the tensor carries (a ``Parameter`` stays
    one, ``requires_grad``, attributes set on it): the receiver may have no such device, and the fork server
    must never touch one. A view copies the elements it sees, not the storage it looks into."""
    import torch

    copy = tensor.detach().cpu()
    if isinstance(tensor, torch.nn.Parameter):
        copy = torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
    elif tensor.requires_grad:
        copy.requires_grad_()
    copy.__dict__.update(tensor.__dict__)
    return copy
