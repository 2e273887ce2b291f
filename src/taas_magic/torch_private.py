"""torch's private functions that taas uses, each behind one function here, where no public one does the job.

A torch release that moves or drops one fails ``tests/unit/test_torch_private.py``, which names
torch's version and the function; each caller has a way on without it, so a user's run goes on:

- ``torch.cuda._device_count_nvml``: the GPUs NVML sees, without creating a CUDA context (the public
  ``device_count`` may make later forks unable to use CUDA). Without it: a subprocess counts them.
- ``torch._C._cuda_isInBadFork``: whether a forked child could use CUDA; torch has no public question.
  Without it: "not known", and the kernel then judges by what it knows itself.
- ``torch._C._distributed_c10d._dump_fr_trace`` and ``_dump_nccl_trace``: the flight recorder's rings of
  collectives, read in the rank (the public way writes files on a signal). Without them: the hang
  doctor sees no collective, and says where each rank is by its stack alone.
- ``torch.distributed.distributed_c10d._get_default_group`` and ``_world.pg_map``: the default group, and
  whether a group made earlier still exists (``destroy_process_group`` may have ended it). Without them: a
  session cell in part of the ranks makes its exchange group anew each time.
- ``Module._forward_hooks`` and the other hook dicts (``MODULE_HOOKS``, ``MODULE_HOOK_TABLES``), FSDP's marks on
  the modules it manages (``FSDP_MODULE_MARKS``) and the composable API's state key (``COMPOSABLE_STATE_PREFIX``):
  what a module sent back to the notebook sheds of FSDP2 and tensor parallelism. Without them: the module comes
  back with what torch pickles of them.
- FSDP2's ``_get_fsdp_state()._fsdp_param_group.fsdp_params`` (each with ``sharded_param`` and
  ``_module_info``): the parameters FSDP holds unsharded after a forward. Without them: those come back full,
  apart from the optimizer's.
- ``Tensor._version``: a tensor's in-place change counter, by which a session knows its ranks' copy is current.
  Without it: every tensor is sent again each cell.
- ``torch.distributed.distributed_c10d._new_process_group_helper``, through which ``init_process_group`` and
  ``new_group`` make every group, and ``_reconfigure``, which connects a group anew in place: a session rank
  knows its groups' connections, cuts them when its cell fails so that no peer waits for it, and the group is
  connected again under the user's objects (``rank/group_links.py``). Without them: a rank's failure in a
  collective leaves its peers waiting, and the session ends, as before.
- ``DistributedDataParallel._comm_hooks``: the communication hooks a DDP model was given, registered again on the
  reducer it is given when its group is connected anew. Without it: such a model trains on with DDP's own
  all-reduce.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

FLIGHT_RECORDER_DUMPS = ("_dump_fr_trace", "_dump_nccl_trace")  # every backend's ring; NCCL's own ring
# A module's hooks, by each hook's handle id, and the tables that say how each hook is called.
MODULE_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
MODULE_HOOK_TABLES = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
FSDP_MODULE_MARKS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")  # FSDP's marks on the modules it manages
COMPOSABLE_STATE_PREFIX = "__composable_api_state_key_"  # fully_shard's state, by torch's composable API


def device_count_nvml(torch: Any) -> int | None:
    """The GPUs NVML sees (None: not known, this torch lacks the function or NVML failed)."""
    count = getattr(torch.cuda, "_device_count_nvml", None)
    if count is None:
        return None
    try:
        found = int(count())
    except Exception:  # no NVML library, no driver
        return None
    return found if found >= 0 else None


def in_bad_fork(torch: Any) -> bool | None:
    """In a forked child: whether CUDA is unusable here (None: this torch cannot say)."""
    ask = getattr(torch._C, "_cuda_isInBadFork", None)
    return None if ask is None else bool(ask())


def flight_recorder_dumps() -> list[Callable[[bool, bool, bool], bytes]]:
    """The flight recorder's readers this torch has: each ``(entries, stacks, only_active)`` -> a pickle."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:  # a build without torch.distributed
        return []
    return [reader for reader in (getattr(c10d, name, None) for name in FLIGHT_RECORDER_DUMPS) if reader is not None]


def default_group(dist: Any) -> Any:
    """The default process group (``init_process_group``'s)."""
    return dist.distributed_c10d._get_default_group()


def group_exists(dist: Any, group: Any) -> bool:
    """Whether ``group`` is still one of the process groups (False once destroyed, or where this torch cannot say)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return group in getattr(world, "pg_map", {})


def fsdp_managed(module: Any) -> list[tuple[Any, Any]] | None:
    """(sharded parameter, its module info) for each parameter of the FSDP2 unit ``module``; None where it is no
    such unit or this torch keeps them elsewhere."""
    fsdp_state = getattr(module, "_get_fsdp_state", None)
    if fsdp_state is None:
        return None
    try:
        group = fsdp_state()._fsdp_param_group
        return [(param.sharded_param, param._module_info) for param in (group.fsdp_params if group else ())]
    except Exception:
        return None


def version_counter(tensor: Any) -> int:
    """How many in-place changes ``tensor``'s data has seen; where this torch does not say, a number never given
    before, so that the tensor always reads as changed (and is sent again)."""
    version = getattr(tensor, "_version", None)
    return next(_UNKNOWN_VERSIONS) if version is None else int(version)


_UNKNOWN_VERSIONS = itertools.count(-1, -1)


GROUP_MAKER = "_new_process_group_helper"


def wrap_group_maker(dist: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None] | None:
    """Make every process group through ``wrap(maker)`` from now on; returns what puts the maker back (None where
    this torch has no such function)."""
    c10d = dist.distributed_c10d
    maker = getattr(c10d, GROUP_MAKER, None)
    if maker is None:
        return None
    setattr(c10d, GROUP_MAKER, wrap(maker))
    return lambda: setattr(c10d, GROUP_MAKER, maker)


def reconfigure(dist: Any, group: Any, uuid: int, handles: list[str], timeout: Any) -> None:
    """Connect ``group`` anew to the peers whose handles (``group.get_reconfigure_handle()``) are given in rank
    order, as communicator ``uuid``; the user's objects that hold the group (DDP's reducer) keep working."""
    dist.distributed_c10d._reconfigure(uuid=uuid, handles=handles, group=group, timeout=timeout).wait()


def renew_reducer(model: Any) -> None:
    """Give DDP ``model`` a new reducer, as a copy of it unpickled has: every rank's then starts from its first
    iteration together, whatever iteration a collective that failed left the old one in. Its communication hooks
    are registered on the new one."""
    hooks = list(getattr(model, "_comm_hooks", ()))
    model.__setstate__(model.__getstate__())
    if hasattr(model, "_comm_hooks"):
        model._comm_hooks = []
    for hook, state in hooks:
        model.register_comm_hook(state, hook)


def missing(torch: Any) -> list[str]:
    """The private functions and attributes of this module that ``torch`` lacks."""
    absent = [] if hasattr(torch.cuda, "_device_count_nvml") else ["torch.cuda._device_count_nvml"]
    absent += [] if hasattr(torch._C, "_cuda_isInBadFork") else ["torch._C._cuda_isInBadFork"]
    if not flight_recorder_dumps():
        absent.append("torch._C._distributed_c10d." + " and ".join(FLIGHT_RECORDER_DUMPS))
    c10d = getattr(getattr(torch, "distributed", None), "distributed_c10d", None)
    if not hasattr(c10d, "_get_default_group"):
        absent.append("torch.distributed.distributed_c10d._get_default_group")
    if not hasattr(getattr(c10d, "_world", None), "pg_map"):
        absent.append("torch.distributed.distributed_c10d._world.pg_map")
    absent += [
        f"torch.distributed.distributed_c10d.{name}"
        for name in (GROUP_MAKER, "_reconfigure")
        if not hasattr(c10d, name)
    ]
    ddp = getattr(getattr(getattr(torch, "nn", None), "parallel", None), "DistributedDataParallel", None)
    if ddp is not None and "_comm_hooks" not in ddp.__init__.__code__.co_names:
        absent.append("torch.nn.parallel.DistributedDataParallel._comm_hooks")
    module_class = getattr(getattr(torch, "nn", None), "Module", None)
    if module_class is not None:
        module = module_class()
        absent += [f"torch.nn.Module.{name}" for name in MODULE_HOOKS + MODULE_HOOK_TABLES if not hasattr(module, name)]
    tensor_of = getattr(torch, "zeros", None)
    if tensor_of is not None and not hasattr(tensor_of(1), "_version"):
        absent.append("torch.Tensor._version")
    return absent
