"""Sharded values come back whole: DTensors, and modules whose parameters are DTensors (FSDP2, tensor parallel).

At the end of a cell every rank that ran it calls ``gather`` with the cell's names, while the process
group is still up. Where the names hold sharded tensors, the ranks first agree on them: one small
``all_gather_object`` of (name, path, shape, dtype, mesh, placements) over the ranks that run the
cell, after which a tensor that differs between ranks, or whose mesh reaches ranks that do not run
the cell, is named in a why instead of waited for. Then they gather each sharded tensor with
``full_tensor()``, one at a time and in one order everywhere, to CPU. A rank that sends its names
keeps the full tensors for the pickler (``results.dumps``), which writes each DTensor as its full
tensor and each FSDP2 or tensor-parallel module as a plain module of its own class; the others drop
each at once. The ranks' live objects are never changed: a session goes on training its sharded model.

Where DTensors are looked for: a name bound to one; a module's parameters and buffers (and, for the
parameters FSDP2 holds unsharded after a forward, the sharded ones its optimizer holds); an
optimizer's parameters and state (FSDP2 optimizers hold DTensor state); and dicts, lists and tuples
of these (``model.state_dict()``), ``_DEPTH`` deep and ``_ITEMS`` long at most. A DTensor anywhere
else (an attribute of some other object) is not gathered; the pickler then leaves its name out,
saying so.

Nothing runs, not even a look at the names, where ``torch.distributed.tensor`` was never imported:
no DTensor can exist there. A rank whose names hold nothing sharded takes part in no collective.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from taas_magic import torch_private
from taas_magic.errors import first_line
from taas_magic.per_rank import span

_DTENSOR_MODULE = "torch.distributed.tensor"
_DEPTH = 4  # how deep dicts, lists and tuples are looked into
_ITEMS = 10_000  # longer containers are not looked into: a list of a million numbers holds no model

DESTROYED = (
    "sharded, and its process group was destroyed before the cell ended: keep the process group "
    "up to the end of the cell (no destroy_process_group()) and taas gathers it whole then"
)


class Whole:
    """The full values of the sharded tensors among a cell's names, by the id of each sharded tensor.

    It holds the sharded tensors too, so that each id stays theirs while the names are pickled.
    """

    def __init__(self, resting: dict[int, tuple[Any, dict[str, Any]]] | None = None) -> None:
        self._full: dict[int, tuple[Any, Any]] = {}  # id(sharded) -> (sharded, its full CPU tensor)
        self._resting = resting or {}  # id(module) -> (module, {name: the sharded parameter FSDP keeps for it})

    def add(self, sharded: Any, full: Any) -> None:
        self._full[id(sharded)] = (sharded, full)

    def full(self, sharded: Any) -> Any | None:
        """The full CPU tensor of ``sharded``; None where it was not gathered."""
        entry = self._full.get(id(sharded))
        return entry[1] if entry is not None and entry[0] is sharded else None

    def sharded_parameters(self, module: Any) -> Mapping[str, Any]:
        """{name: sharded parameter} for the parameters of ``module`` that FSDP holds unsharded right now
        (the root's, after a forward): written in their place, they come back one with the optimizer's."""
        entry = self._resting.get(id(module))
        return entry[1] if entry is not None and entry[0] is module else {}

    def __len__(self) -> int:
        return len(self._full)


@dataclass(frozen=True)
class _Sharded:
    """One sharded tensor as the ranks compare it before gathering: equal in every rank of its mesh, or not gathered."""

    name: str  # the cell's name it was first found under
    path: str  # where: "model.layers.0.weight", "optimizer.state[0]['exp_avg']"
    shape: tuple[int, ...]
    dtype: str
    mesh: tuple[int, ...]  # the ranks of its device mesh, in mesh order
    mesh_shape: tuple[int, ...]
    placements: str
    up: bool  # its mesh's process groups still exist

    def looks(self) -> str:
        return f"{list(self.shape)} {self.dtype.removeprefix('torch.')} {self.placements} over {span(self.mesh)}"


def gather(
    values: Mapping[str, Any], send: bool, running: frozenset[int] | None
) -> tuple[Whole | None, dict[str, str]]:
    """Gather the sharded tensors among ``values`` (collective: every rank that runs the cell calls it
    with the same names); {name: why} for those that cannot come back whole."""
    if _DTENSOR_MODULE not in sys.modules:
        return None, {}
    import torch.distributed as dist

    found, needs, resting = _find(values, sys.modules[_DTENSOR_MODULE].DTensor)
    if not found:
        # No collective where this rank holds nothing sharded: a session's cell that raised in another rank
        # must not leave this one waiting in a collective that never ends. (Ranks that disagree here, some
        # holding sharded values and some none, leave the others waiting until the run ends.)
        return None, {}
    if not (dist.is_available() and dist.is_initialized()):
        return None, {name: DESTROYED for name, ids in needs.items() if ids}
    try:
        group, ranks = _exchange_group(dist, running)
        mine = [_describe(name, path, tensor) for name, path, tensor in found]
        every: list[Any] = [None] * len(ranks)
        dist.all_gather_object(every, mine, group=group)
    except Exception as e:  # a rank went away, or the group is unusable: nothing is gathered
        absent = (
            f"sharded, and not every rank running the cell took part in gathering it (one holds nothing "
            f"sharded under the cell's names, or left): {_short(first_line(e))}"
        )
        return None, {name: absent for name, ids in needs.items() if ids}
    theirs = dict(zip(ranks, every))
    problems = {
        id(tensor): why
        for (_, _, tensor), described in zip(found, mine)
        if (why := _why_not(described, theirs, running, dist.get_rank()))
    }
    order = _order(theirs)
    plan = sorted(
        (item for item in zip(found, mine) if id(item[0][2]) not in problems), key=lambda item: order[item[1]]
    )
    whole = Whole(resting)
    for (_, _, tensor), described in plan:
        try:
            full = _full(tensor, keep=send)
        except Exception as e:  # the group broke midway: what is left cannot be gathered either
            failed = f"gathering {described.path} failed: {_short(first_line(e))}"
            problems.update({id(t): failed for _, _, t in found if whole.full(t) is None and id(t) not in problems})
            break
        if send:
            whole.add(tensor, full)
        del full  # a rank that does not send holds one full tensor at a time
    whys = {
        name: next(problems[i] for i in ids if i in problems)
        for name, ids in needs.items()
        if any(i in problems for i in ids)
    }
    return (whole if send else None), whys


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _find(
    values: Mapping[str, Any], dtensor: type
) -> tuple[list[tuple[str, str, Any]], dict[str, list[int]], dict[int, tuple[Any, dict[str, Any]]]]:
    """The DTensors among ``values``, each once, in the order the names and their parts come: (name,
    path, tensor); the ids of the DTensors each name holds; and the parameters FSDP keeps sharded
    while their modules hold them unsharded, by module (``Whole.sharded_parameters``)."""
    found: list[tuple[str, str, Any]] = []
    needs: dict[str, list[int]] = {}
    known: set[int] = set()
    resting: dict[int, tuple[Any, dict[str, Any]]] = {}
    for name, value in values.items():
        ids = needs.setdefault(name, [])
        try:
            parts = list(_walk(value, name, dtensor, 0, set(), resting))
        except Exception:  # an object that fails even this look (a dict whose items() raises): not looked into
            parts = []
        for path, tensor in parts:
            if id(tensor) not in ids:
                ids.append(id(tensor))
            if id(tensor) not in known:
                known.add(id(tensor))
                found.append((name, path, tensor))
    return found, needs, resting


def _walk(
    value: Any, path: str, dtensor: type, depth: int, seen: set[int], resting: dict[int, tuple[Any, dict[str, Any]]]
) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dtensor):
        yield path, value
        return
    if id(value) in seen or depth > _DEPTH:
        return
    torch = sys.modules["torch"]
    if isinstance(value, torch.nn.Module):
        seen.add(id(value))
        for part, tensor in [*value.named_parameters(), *value.named_buffers()]:
            if isinstance(tensor, dtensor):
                yield f"{path}.{part}", tensor
        for prefix, module in value.named_modules():
            for owner, part, parameter in _unsharded_now(module):
                resting.setdefault(id(owner), (owner, {}))[1][part] = parameter
                yield f"{path}.{prefix}{'.' if prefix else ''}{part} (sharded)", parameter
    elif isinstance(value, torch.optim.Optimizer):
        seen.add(id(value))
        for g, group in enumerate(value.param_groups):
            for p, parameter in enumerate(group.get("params", ())):
                if isinstance(parameter, dtensor):
                    yield f"{path}.param_groups[{g}]['params'][{p}]", parameter
                for key, state in value.state.get(parameter, {}).items():
                    if isinstance(state, dtensor):
                        yield f"{path}.state[{g}.{p}][{key!r}]", state
    elif isinstance(value, dict) and len(value) <= _ITEMS:
        seen.add(id(value))
        for key, item in value.items():
            yield from _walk(item, f"{path}[{key!r}]", dtensor, depth + 1, seen, resting)
    elif isinstance(value, (list, tuple)) and len(value) <= _ITEMS:
        seen.add(id(value))
        for index, item in enumerate(value):
            yield from _walk(item, f"{path}[{index}]", dtensor, depth + 1, seen, resting)


def _unsharded_now(module: Any) -> Iterator[tuple[Any, str, Any]]:
    """(module, name, sharded parameter) for each parameter that the FSDP2 unit ``module`` manages and
    that its module holds unsharded right now: FSDP leaves the root's parameters unsharded after a
    forward. The optimizer holds the sharded ones; they are gathered and written in the module's place,
    so that model and optimizer still share them in the notebook. (FSDP's internals: where they
    change, the unsharded parameters come back as they are, full but apart from the optimizer's.)"""
    for sharded, info in torch_private.fsdp_managed(module) or []:
        for owner, name in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
            if owner._parameters.get(name) is not sharded:
                yield owner, name, sharded


def _describe(name: str, path: str, tensor: Any) -> _Sharded:
    mesh = tensor.device_mesh
    try:
        for dim in range(mesh.ndim):
            mesh.get_group(dim)
        up = True
    except Exception:  # its groups were destroyed (or never made in this rank)
        up = False
    return _Sharded(
        name,
        path,
        tuple(tensor.shape),
        str(tensor.dtype),
        tuple(mesh.mesh.flatten().tolist()),
        tuple(mesh.mesh.shape),
        str(tuple(tensor.placements)),
        up,
    )


_exchange_groups: dict[tuple[int, frozenset[int]], Any] = {}  # (the default group's id, running ranks) -> group


def _exchange_group(dist: Any, running: frozenset[int] | None) -> tuple[Any, list[int]]:
    """The group of the ranks that run the cell, and its ranks: the default group, unless a session's
    cell runs in part of them; that group is made once and kept for the next such cell."""
    world = dist.get_world_size()
    if running is None or running >= frozenset(range(world)):
        return None, list(range(world))
    key = (id(torch_private.default_group(dist)), running)
    group = _exchange_groups.get(key)
    if group is None or not torch_private.group_exists(dist, group):  # new, or destroyed since
        group = _exchange_groups[key] = dist.new_group(sorted(running), use_local_synchronization=True)
    return group, sorted(running)


def _why_not(
    described: _Sharded, theirs: dict[int, list[_Sharded]], running: frozenset[int] | None, me: int
) -> str | None:
    """Why this rank's sharded tensor cannot be gathered; every rank of its mesh comes to the same answer."""
    if not described.up:
        return DESTROYED
    outside = [rank for rank in described.mesh if rank not in theirs]
    if outside:
        return (
            f"sharded over {span(described.mesh)}, and {span(outside)} do not run this cell"
            if running is None
            else f"sharded over {span(described.mesh)}, and this cell runs in {span(running)} only"
        )
    for rank in described.mesh:
        if described not in theirs[rank]:
            other = next((d for d in theirs[rank] if (d.name, d.path) == (described.name, described.path)), None)
            if other is not None and not other.up:
                return DESTROYED
            return (
                f"its ranks disagree on {described.path}: {described.looks()} in rank {me}, "
                f"{other.looks() if other else 'no such sharded tensor'} in rank {rank}"
            )
    return None


def _order(theirs: dict[int, list[_Sharded]]) -> dict[_Sharded, int]:
    """One order of all the ranks' sharded tensors, the same in every rank: each rank gathers its own in
    this order, so no two ranks ever wait on each other in different collectives."""
    order: dict[_Sharded, int] = {}
    for rank in sorted(theirs):
        for described in theirs[rank]:
            order.setdefault(described, len(order))
    return order


def _full(tensor: Any, keep: bool) -> Any:
    """The full value of a DTensor, on CPU, apart from autograd and from the live tensor's memory; None
    where it is not kept (the rank took part in the collectives only)."""
    torch = sys.modules["torch"]
    with torch.no_grad():
        full = tensor.full_tensor()
        wait = getattr(full, "wait", None)  # an AsyncCollectiveTensor: the collective must have finished
        if callable(wait):
            full = wait()
        if not keep:
            return None
        local = tensor.to_local()
        on_cpu = full.detach().cpu()
        if on_cpu.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            on_cpu = on_cpu.clone()  # replicated: full_tensor() gave the live tensor itself
        return on_cpu
