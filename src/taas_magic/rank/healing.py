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
import pickle
import re
import sys
import time
from typing import Any

import cloudpickle

# IPython's own names, and the notebook's output history: not state of the user's.
_IPYTHON = frozenset({"In", "Out", "exit", "quit", "get_ipython", "_", "__", "___", "_i", "_ii", "_iii", "_ih", "_oh"})
_HISTORY = re.compile(r"_i?\d+|_dh")


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
        if torch is not None and isinstance(obj, torch.nn.Module):
            return _state, (type(obj).__qualname__, obj.training, list(obj.state_dict(keep_vars=True).items()))
        if torch is not None and isinstance(obj, torch.optim.Optimizer):
            return _state, (type(obj).__qualname__, obj.state_dict())
        return super().reducer_override(obj)


def _state(*what: Any) -> None:
    """What a digest writes a module or an optimizer as (never called: a digest's pickle is never loaded)."""


def heal(namespace: dict[str, Any], newcomers: tuple[int, ...]) -> None:
    """In every rank of the session at once, its group connected anew: the lowest survivor gives each newcomer the
    names every survivor holds alike."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    survivors = [peer for peer in range(world) if peer not in newcomers]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, {} if rank in newcomers else digests(namespace))
    same = sorted(
        name
        for name, digest in every[survivors[0]].items()
        if all(every[peer].get(name) == digest for peer in survivors[1:])
    )
    donor = survivors[0]
    if rank == donor:
        payload = cloudpickle.dumps(({name: namespace[name] for name in same}, sorted(sys.modules)), protocol=5)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        for newcomer in newcomers:
            dist.send(torch.tensor([data.numel()], dtype=torch.int64), newcomer)
            dist.send(data, newcomer)
    elif rank in newcomers:
        started = time.monotonic()
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, donor)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, donor)
        names, modules = pickle.loads(data.numpy().tobytes())
        namespace.update(names)
        copied = time.monotonic()
        _import(modules)
        held = set().union(*(every[peer] for peer in survivors))
        lost = sorted(held - set(same))
        for name in lost:  # what the process was forked with (the notebook's) would be no rank's value
            namespace.pop(name, None)
        _say_healed(rank, donor, len(same), int(size), copied - started, time.monotonic() - copied, lost)
        if len(survivors) == 1:
            print(
                f"taas: rank {donor} is the only other rank, so nothing tells its own values (its RANK, its data "
                f"shard) from the others': names that held rank {donor}'s own hold it in rank {rank} too",
                file=sys.stderr,
                flush=True,
            )


def _import(modules: list[str]) -> None:
    """Import what the donor had imported: the newcomer's first training step would otherwise pay for torch's
    modules that load on first use (a second and more, while its peers wait for it in their collective)."""
    for name in modules:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # a module that cannot be imported twice, or here: the cell will say, if it matters
                continue


def _say_healed(rank: int, donor: int, names: int, size: int, seconds: float, imports: float, lost: list[str]) -> None:
    line = (
        f"taas: rank {rank} is a new process in place of the one that died: {names} name{'s' * (names != 1)} "
        f"copied from rank {donor} ({size / 1e6:.1f} MB in {seconds:.2f} s), its modules imported ({imports:.1f} s)"
    )
    if lost:
        line += f"; not the same in every other rank, so not copied (set them again in this rank): {', '.join(lost)}"
    print(line, file=sys.stderr, flush=True)
