"""A replaced rank's state, copied from a live peer: every name the surviving ranks hold alike.

When a session's rank dies (SIGKILL, a crash, ``os._exit``), the supervisor starts a new process in its place
(``RankTask.joins``) and the kernel sends every rank one cell with no code, naming the newcomers
(``SessionCell.reconnect``). Every rank connects the process group anew, the newcomer joining it
(``group_links.py``). Then each survivor says what each of its names holds (a digest of its pickle), and the
lowest survivor gives the newcomers every name whose digest is the same in every survivor, in one pickle over
the process group: a model and its optimizer stay one model and its optimizer, and a DDP model comes back
around the newcomer's group. A name that differs between the survivors (a rank's data shard, its ``RANK``) is
not invented: the newcomer says in one line which it lacks, and lacks it (the value it was forked with, the
notebook's, would be no rank's).
With one survivor nothing tells its own values from the others', and the newcomer says so.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import marshal
import os
import pickle
import re
import sys
import time
from typing import Any

import cloudpickle

# IPython's own names, and the notebook's output history: not state of the user's.
_IPYTHON = frozenset({"In", "Out", "exit", "quit", "get_ipython", "_", "__", "___", "_i", "_ii", "_iii", "_ih", "_oh"})
_HISTORY = re.compile(r"_i?\d+|_dh")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def copied_names(namespace: dict[str, Any]) -> list[str]:
    """The names a newcomer may be given: the user's, not Python's or IPython's."""
    return [
        name
        for name in namespace
        if not (name.startswith("__") and name.endswith("__")) and name not in _IPYTHON and not _HISTORY.fullmatch(name)
    ]


def digests(namespace: dict[str, Any]) -> dict[str, str]:
    """What each name holds, as a digest of its pickle; a value that cannot be pickled is left out (a newcomer
    cannot be given it)."""
    found = {}
    for name in copied_names(namespace):
        out = io.BytesIO()
        try:
            _Digesting(out, protocol=5).dump(namespace[name])
        except Exception:
            continue
        found[name] = hashlib.blake2b(out.getbuffer(), digest_size=16).hexdigest()
    return found


class _Digesting(cloudpickle.Pickler):
    """A pickle that stands for the value it pickles, the same in every rank that holds the same value: a tensor is
    written as its type, shape and a digest of its bytes (torch's own pickle of a tensor differs from one call to
    the next), without copying it; a module and an optimizer as their state dicts (their hooks are keyed by numbers
    each process counts on its own)."""

    def persistent_id(self, obj: Any) -> Any:
        import torch

        if not isinstance(obj, torch.Tensor):
            return None
        tensor = obj.detach().cpu().contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy().data
        return (
            type(obj).__name__,
            str(tensor.dtype),
            tuple(tensor.shape),
            obj.requires_grad,
            hashlib.blake2b(data).hexdigest(),
        )

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if isinstance(obj, type) and _defined_here(obj):
            return _state, (obj.__module__, obj.__qualname__, _definition(obj))
        if torch is not None and isinstance(obj, torch.nn.Module):
            return _state, (type(obj).__qualname__, obj.training, list(obj.state_dict(keep_vars=True).items()))
        if torch is not None and isinstance(obj, torch.optim.Optimizer):
            return _state, (type(obj).__qualname__, obj.state_dict())
        return super().reducer_override(obj)


def _defined_here(cls: type) -> bool:
    """A class of the notebook's (or of a module nobody can import): cloudpickle writes it by value, with a number
    each process draws for itself the first time it writes it, so its pickle differs from rank to rank."""
    module = sys.modules.get(cls.__module__)
    return module is None or cls.__module__ == "__main__" or getattr(module, cls.__qualname__, None) is not cls


def _definition(cls: type) -> list[tuple[str, Any]]:
    """What makes two ranks' copies of a class the same class: its bases and what it defines, functions by their
    code (the same bytes in every rank that ran the same definition), a property by its functions' code; anything
    else by its repr, less the addresses in it."""
    parts: list[tuple[str, Any]] = [("__bases__", [base.__qualname__ for base in cls.__bases__])]
    for name, value in sorted(vars(cls).items()):
        if name in ("__dict__", "__weakref__", "__module__", "__qualname__"):
            continue
        functions = [value.fget, value.fset, value.fdel] if isinstance(value, property) else [value]
        codes = [getattr(getattr(function, "__func__", function), "__code__", None) for function in functions]
        if any(code is not None for code in codes):
            parts.append((name, [marshal.dumps(code) if code is not None else None for code in codes]))
        else:
            parts.append((name, _ADDRESS.sub("", repr(value))))
    return parts


def _state(*what: Any) -> None:
    """What a digest writes a module or an optimizer as (never called: a digest's pickle is never loaded)."""


def heal(namespace: dict[str, Any], newcomers: tuple[int, ...], joined: bool = False) -> None:
    """In every rank of the session at once, its group connected anew: the lowest survivor gives each newcomer the
    names every survivor holds alike. ``joined``: the newcomers are new ranks of a resize, in place of none."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    survivors = [peer for peer in range(world) if peer not in newcomers]
    if not survivors:
        return  # the kernel heals no session that lost every rank
    every: list[Any] = [None] * world
    dist.all_gather_object(every, {} if rank in newcomers else digests(namespace))
    same = sorted(
        name
        for name, digest in every[survivors[0]].items()
        if all(every[peer].get(name) == digest for peer in survivors[1:])
    )
    donor = survivors[0]
    if rank == donor:
        _give({name: namespace[name] for name in same}, newcomers)
    elif rank in newcomers:
        started = time.monotonic()
        (names, modules), size = _take(donor)
        namespace.update(names)
        copied = time.monotonic()
        _import(modules)
        held = set().union(*(every[peer] for peer in survivors))
        lost = sorted(held - set(same))
        for name in lost:  # what the process was forked with (the notebook's) would be no rank's value
            namespace.pop(name, None)
        why = "a new rank of the session" if joined else "a new process in place of the one that died"
        _say_healed(rank, why, donor, len(same), size, copied - started, time.monotonic() - copied, lost)
        if len(survivors) == 1:
            print(
                f"taas: rank {donor} is the only other rank, so nothing tells its own values (its RANK, its data "
                f"shard) from the others': names that held rank {donor}'s own hold it in rank {rank} too",
                file=sys.stderr,
                flush=True,
            )


def _give(names: dict[str, Any], newcomers: tuple[int, ...]) -> None:
    """The donor's side: the names' pickle, with each tensor in it replaced by its number, then each tensor's
    elements as they lie in memory, sent straight from it (no copy into the pickle and out again)."""
    import torch
    import torch.distributed as dist

    out = io.BytesIO()
    pickler = _Giving(out)
    pickler.dump((names, sorted(sys.modules)))
    tensors = [tensor.detach().cpu().contiguous() for tensor in pickler.tensors]
    head = pickle.dumps((out.getvalue(), [(str(tensor.dtype), tuple(tensor.shape)) for tensor in tensors]))
    for newcomer in newcomers:
        dist.send(torch.tensor([len(head)], dtype=torch.int64), newcomer)
        dist.send(torch.frombuffer(bytearray(head), dtype=torch.uint8), newcomer)
        for tensor in tensors:
            if tensor.numel():
                dist.send(tensor.reshape(-1).view(torch.uint8), newcomer)


def _take(donor: int) -> tuple[Any, int]:
    """A newcomer's side of ``_give``: what the pickle holds, and how many bytes came."""
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, donor)
    head = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(head, donor)
    data, layouts = pickle.loads(head.numpy().tobytes())
    tensors = []
    for dtype, shape in layouts:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
        if tensor.numel():
            dist.recv(tensor.reshape(-1).view(torch.uint8), donor)
        tensors.append(tensor)
    received = int(size) + sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    return _Taking(io.BytesIO(data), tensors).load(), received


class _Giving(cloudpickle.Pickler):
    """Pickles every tensor as its number among those sent beside the pickle; one tensor met twice (a parameter
    tied to two modules, an optimizer's reference to a model's) is one number, and one tensor again."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=5)
        self.tensors: list[Any] = []
        self.numbers: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        torch = sys.modules["torch"]
        if not isinstance(obj, torch.Tensor) or obj.layout != torch.strided or obj.is_quantized:
            return None  # a sparse or quantized tensor goes in the pickle, as torch pickles it
        if id(obj) not in self.numbers:
            self.numbers[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return ("tensor", self.numbers[id(obj)], isinstance(obj, torch.nn.Parameter), obj.requires_grad)


class _Taking(pickle.Unpickler):
    def __init__(self, file: Any, tensors: list[Any]) -> None:
        super().__init__(file)
        self.tensors = tensors
        self.made: dict[int, Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        import torch

        _, number, parameter, requires_grad = pid
        if number not in self.made:
            tensor = self.tensors[number]
            self.made[number] = (
                torch.nn.Parameter(tensor, requires_grad) if parameter else tensor.requires_grad_(requires_grad)
            )
        return self.made[number]


def _import(modules: list[str]) -> None:
    """Import what the donor had imported: the newcomer's first training step would otherwise pay for torch's
    modules that load on first use (a second and more, while its peers wait for it in their collective)."""
    for name in modules:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # a module that cannot be imported twice, or here: the cell will say, if it matters
                continue


def say_ungrouped(joined: bool) -> None:
    """A newcomer where the ranks have no process group to copy names over (none called ``init_process_group``)."""
    rank = os.environ.get("RANK", "?")
    why = "a new rank of the session" if joined else "a new process in place of the one that died"
    print(
        f"taas: rank {rank} is {why}: the ranks have no process group to copy names over, so it holds the "
        "notebook's names as they were when the session started",
        file=sys.stderr,
        flush=True,
    )


def _say_healed(
    rank: int, why: str, donor: int, names: int, size: int, seconds: float, imports: float, lost: list[str]
) -> None:
    line = (
        f"taas: rank {rank} is {why}: {names} name{'s' * (names != 1)} "
        f"copied from rank {donor} ({size / 1e6:.1f} MB in {seconds:.2f} s), its modules imported ({imports:.1f} s)"
    )
    if lost:
        line += f"; not the same in every other rank, so not copied (set them again in this rank): {', '.join(lost)}"
    print(line, file=sys.stderr, flush=True)
