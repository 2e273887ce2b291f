"""Sharded models and tensors come back whole: real gloo ranks on CPU gather them (``rank/sharded.py``),
the sending rank pickles them (``wire/results.py``), and this process unpickles them as the kernel does.

Each test forks its ranks; a scenario runs in every rank and hands back what the test looks at.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import queue
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from hypothesis import given, settings
from support.notebook_values import SETUP, unpicklable, values
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from taas_magic.rank import sharded
from taas_magic.wire import results


class Net(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.embed = nn.Linear(5, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(2))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(self.norm(x)) * self.scale


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 5, generator=generator), torch.randint(0, 3, (6,), generator=generator)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, ranks: list[int], steps: int) -> None:
    """``steps`` AdamW steps; with several ranks given, on their batches together (as one unsharded model
    sees what FSDP's ranks see, gradients averaged)."""
    for step in range(steps):
        inputs, targets = (torch.cat(parts) for parts in zip(*(batch(rank, step) for rank in ranks)))
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def fresh() -> Net:
    torch.manual_seed(0)
    return Net()


def hooks(module: nn.Module) -> int:
    return sum(
        len(getattr(m, key))
        for m in module.modules()
        for key in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    )


# -- running ranks ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(scenario: Callable[[int, int], dict], rank: int, world: int, port: int, answers: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo")
        answers.put((rank, scenario(rank, world), None))
    except BaseException:
        answers.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    answers.close()
    answers.join_thread()
    os._exit(0)


def run_ranks(scenario: Callable[[int, int], dict], world: int = 2, timeout: float = 60) -> list[dict]:
    """Run ``scenario(rank, world)`` in ``world`` forked gloo ranks; what each returned, by rank."""
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank, args=(scenario, rank, world, port, answers)) for rank in range(world)]
    for process in processes:
        process.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            try:
                rank, answer, failure = answers.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(got))} did not finish in {timeout} s")
            assert failure is None, f"rank {rank} failed:\n{failure}"
            got[rank] = answer
        for process in processes:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
            assert process.exitcode == 0, f"a rank ended with {process.exitcode}"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [got[rank] for rank in range(world)]


def end_of_cell(values: dict, rank: int, running: frozenset[int] | None = None) -> dict:
    """What rank/cell.py does at the end of a cell: gather in every rank, pickle in rank 0."""
    started = time.monotonic()
    whole, whys = sharded.gather(values, rank == 0, running)
    gathered = time.monotonic() - started
    if rank != 0:
        return {"whole": whole, "whys": whys, "seconds": gathered}
    data, left_out = results.dumps({name: value for name, value in values.items() if name not in whys}, whole)
    return {"data": data.to_bytes(), "whys": whys, "unpicklable": left_out, "seconds": gathered}


# -- FSDP2 ------------------------------------------------------------------------------------
def fsdp_cell(rank: int, world: int) -> dict:
    model = fresh()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, optimizer, [rank], steps=3)
    weight = model.layers[0][0].weight
    local_before = {name: p.to_local().clone() for name, p in model.named_parameters()}
    classes, hooks_before = [type(m) for m in model.modules()], hooks(model)
    values = {
        "model": model,
        "optimizer": optimizer,
        "weight": weight,
        "state": model.state_dict(),
        "bare": weight.detach(),
        "plain": torch.arange(3),
    }
    answer = end_of_cell(values, rank)
    # The live objects are as they were: still sharded, with FSDP's hooks, and they still train.
    answer["unchanged"] = (
        [type(m) for m in model.modules()] == classes
        and hooks(model) == hooks_before
        and all(
            isinstance(p, DTensor) and torch.equal(p.to_local(), local_before[name])
            for name, p in model.named_parameters()
        )
        and isinstance(model, FSDPModule)
        and isinstance(optimizer.state[weight]["exp_avg"], DTensor)
    )
    train(model, optimizer, [rank], steps=1)
    answer["trains"] = not torch.equal(weight.to_local(), local_before["layers.0.0.weight"])
    return answer


def test_an_fsdp2_model_its_optimizer_and_its_tensors_come_back_whole_and_plain():
    rank0, rank1 = run_ranks(fsdp_cell)
    assert rank0["whys"] == rank0["unpicklable"] == {} and rank1["whys"] == {}
    assert rank1["whole"] is None, "a rank that does not send keeps nothing"
    assert rank0["unchanged"] and rank1["unchanged"] and rank0["trains"] and rank1["trains"]
    back, lost = results.loads(rank0["data"])
    assert lost == {}
    model, optimizer = back["model"], back["optimizer"]

    assert type(model) is Net and not any(isinstance(m, FSDPModule) for m in model.modules())
    assert hooks(model) == 0 and not any(k.startswith("__composable") for m in model.modules() for k in vars(m))
    assert all(type(p) is nn.Parameter and p.requires_grad for p in model.parameters())
    reference = fresh()
    train(reference, torch.optim.AdamW(reference.parameters(), lr=0.01), [0, 1], steps=3)
    expected = reference.state_dict()
    assert model.state_dict().keys() == expected.keys()
    for name, value in model.state_dict().items():
        assert type(value) is torch.Tensor and torch.allclose(value, expected[name], rtol=1e-5, atol=1e-6), name
    inputs = batch(7, 7)[0]
    assert torch.allclose(model(inputs), reference(inputs), rtol=1e-5, atol=1e-6)

    assert back["weight"] is model.layers[0][0].weight, "names that share a parameter still share it"
    assert optimizer.param_groups[0]["params"][0] is model.embed.weight
    state = optimizer.state[model.layers[0][0].weight]
    assert type(state["exp_avg"]) is torch.Tensor and state["exp_avg"].shape == (8, 8)
    train(model, optimizer, [0], steps=1)  # the optimizer drives the model it came with, on CPU
    assert not torch.allclose(model.layers[0][0].weight, expected["layers.0.0.weight"])

    assert type(back["bare"]) is torch.Tensor and torch.equal(back["bare"], back["state"]["layers.0.0.weight"])
    assert not back["bare"].requires_grad and back["state"]["head.bias"].shape == (3,)
    assert torch.equal(back["plain"], torch.arange(3))


def evaluated_cell(rank: int, world: int) -> dict:
    model = fresh()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, optimizer, [rank], steps=2)
    with torch.no_grad():
        model(batch(rank, 9)[0])  # an evaluation at the end: FSDP keeps the root's parameters unsharded after it
    root_unsharded = not isinstance(model.embed.weight, DTensor) and isinstance(model.layers[0][0].weight, DTensor)
    answer = end_of_cell({"optimizer": optimizer, "model": model}, rank)
    answer["root_unsharded"] = root_unsharded and not isinstance(model.embed.weight, DTensor)
    return answer


def test_a_model_evaluated_last_still_shares_its_parameters_with_its_optimizer():
    rank0, _ = run_ranks(evaluated_cell)
    assert rank0["root_unsharded"] and rank0["whys"] == rank0["unpicklable"] == {}
    back, _ = results.loads(rank0["data"])
    model, optimizer = back["model"], back["optimizer"]
    assert type(model) is Net and hooks(model) == 0
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    reference = fresh()
    train(reference, torch.optim.AdamW(reference.parameters(), lr=0.01), [0, 1], steps=2)
    for name, value in reference.state_dict().items():
        assert torch.allclose(model.state_dict()[name], value, rtol=1e-5, atol=1e-6), name


# -- tensor parallel ---------------------------------------------------------------------------
def tensor_parallel_cell(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))
    original = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    inputs = torch.randn(3, 4)
    answer = end_of_cell({"model": model, "original": original, "inputs": inputs}, rank)
    answer["still_parallel"] = isinstance(model[0].weight, DTensor) and hooks(model) == 4
    return answer


def test_a_tensor_parallel_model_comes_back_whole_without_its_hooks():
    rank0, _ = run_ranks(tensor_parallel_cell)
    assert rank0["whys"] == rank0["unpicklable"] == {} and rank0["still_parallel"]
    back, lost = results.loads(rank0["data"])
    model, original = back["model"], back["original"]
    assert type(model) is nn.Sequential and hooks(model) == 0
    assert all(type(p) is nn.Parameter for p in model.parameters())
    for (name, value), (_, expected) in zip(model.state_dict().items(), original.state_dict().items()):
        assert torch.equal(value, expected), name
    assert torch.allclose(model(back["inputs"]), original(back["inputs"]))


# -- what cannot come back whole ---------------------------------------------------------------
def destroyed_cell(rank: int, world: int) -> dict:
    model = fully_shard(fresh())
    model(torch.randn(2, 5)).sum().backward()
    dist.barrier()
    dist.destroy_process_group()
    return end_of_cell({"model": model, "loss": 1.5}, rank)


def test_a_model_whose_process_group_was_destroyed_is_left_out_in_one_line_without_waiting():
    rank0, rank1 = run_ranks(destroyed_cell)
    assert rank0["whys"] == rank1["whys"] == {"model": sharded.DESTROYED}
    assert "\n" not in sharded.DESTROYED and "destroy_process_group()" in sharded.DESTROYED
    assert rank0["seconds"] < 1 and rank1["seconds"] < 1
    back, lost = results.loads(rank0["data"])
    assert back == {"loss": 1.5} and lost == {}


def disagreeing_cell(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    differs = DTensor.from_local(torch.ones(2, 3 + rank), mesh, [Shard(0)], run_check=False)
    agrees = DTensor.from_local(torch.full((2, 3), float(rank)), mesh, [Shard(0)], run_check=False)
    only_here = DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False) if rank == 1 else 7
    return end_of_cell({"differs": differs, "agrees": agrees, "only_here": only_here}, rank)


def test_ranks_that_disagree_on_a_sharded_tensor_leave_out_that_name_only():
    rank0, rank1 = run_ranks(disagreeing_cell)
    assert set(rank0["whys"]) == {"differs"} and set(rank1["whys"]) == {"differs", "only_here"}
    assert rank1["whys"]["only_here"] == (
        "its ranks disagree on only_here: [4] float32 (Shard(dim=0),) over ranks 0-1 "
        "in rank 1, no such sharded tensor in rank 0"
    )
    assert rank0["whys"]["differs"] == (
        "its ranks disagree on differs: [4, 3] float32 (Shard(dim=0),) over ranks 0-1 "
        "in rank 0, [4, 4] float32 (Shard(dim=0),) over ranks 0-1 in rank 1"
    )
    back, _ = results.loads(rank0["data"])
    assert torch.equal(back["agrees"], torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))
    assert back["only_here"] == 7


def test_a_dtensor_pickled_without_its_gathered_value_is_left_out_saying_why():
    data, skipped = results.dumps({"kept": 1, "box": [Unreached()]})
    assert skipped == {} and results.loads(data.to_bytes())[0]["kept"] == 1
    rank0, _ = run_ranks(unreached_cell)
    assert set(rank0["unpicklable"]) == {"box"} and rank0["whys"] == {}
    assert "DTensor" in rank0["unpicklable"]["box"]
    assert results.loads(rank0["data"])[0]["kept"] == 1


class Unreached:
    """A DTensor where taas does not look: an attribute of an object of the notebook's own."""

    def __init__(self, tensor: Any = None):
        self.tensor = tensor


def unreached_cell(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    return end_of_cell({"kept": 1, "box": Unreached(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))}, rank)


# -- four ranks: two-dimensional meshes, and a session's cell in part of the ranks -----------
def part_of_four_cell(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    full = torch.arange(32.0).reshape(4, 8)
    both = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    pair = distribute_tensor(full + 10 * (rank // 2), mesh["inner"], [Shard(0)])  # over ranks 0-1, or 2-3
    return end_of_cell({"both": both, "pair": pair}, rank, running=frozenset({0, 1})) if rank < 2 else {}


def test_a_cell_in_part_of_the_ranks_gathers_what_is_sharded_over_them_only():
    rank0, rank1, rank2, _ = run_ranks(part_of_four_cell, world=4)
    full = torch.arange(32.0).reshape(4, 8)
    # The cell ran in ranks 0-1 only, as a session's cell can: "both" is sharded beyond them, "pair" is not.
    assert rank0["whys"] == rank1["whys"] == {"both": "sharded over ranks 0-3, and this cell runs in ranks 0-1 only"}
    back, _ = results.loads(rank0["data"])
    assert set(back) == {"pair"} and torch.equal(back["pair"], full)
    assert rank2 == {}


def all_four_cell(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    full = torch.arange(32.0).reshape(4, 8)
    values = {
        "both": distribute_tensor(full, mesh, [Shard(0), Shard(1)]),
        "mixed": distribute_tensor(full, mesh, [Replicate(), Shard(1)]),
        "pair": distribute_tensor(full + 10 * (rank // 2), mesh["inner"], [Shard(0)]),
    }
    return end_of_cell(values, rank)


def test_four_ranks_gather_two_dimensional_meshes_and_submeshes():
    rank0, *others = run_ranks(all_four_cell, world=4)
    assert rank0["whys"] == {} and all(other["whys"] == {} for other in others)
    back, _ = results.loads(rank0["data"])
    full = torch.arange(32.0).reshape(4, 8)
    assert torch.equal(back["both"], full) and torch.equal(back["mixed"], full) and torch.equal(back["pair"], full)


# -- the common case pays nothing ------------------------------------------------------------
def test_without_torch_distributed_tensor_imported_gather_returns_at_once_without_a_look_at_the_names():
    code = """
import sys, torch
from taas_magic.rank import sharded
class Untouchable(dict):
    def items(self):
        raise AssertionError("looked at the names")
    __iter__ = values = keys = items
print(sharded.gather(Untouchable(model=torch.nn.Linear(2, 2)), True, None), "torch.distributed.tensor" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout == "(None, {}) False\n", done.stderr


# -- the boundary with the notebook ------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(expression=values())
def test_whatever_a_notebook_binds_without_sharded_tensors_is_neither_gathered_nor_changed_in_pickling(expression):
    """None, NaN, mocks, objects whose ``__eq__`` raises (notebook_values.py): ``gather`` finds nothing
    sharded in them and needs no process group; the pickler, now watching for DTensors and FSDP modules,
    writes them as before."""
    namespace: dict = {}
    exec(SETUP, namespace)
    value = eval(expression, namespace)
    assert sharded.gather({"value": value, "raising": namespace["Raising"]()}, True, None) == (None, {})
    data, skipped = results.dumps({"value": value})
    if not unpicklable(expression):
        assert skipped == {} and set(results.loads(data.to_bytes())[0]) == {"value"}
