"""Results come back into the notebook, and only rank 0 writes files."""

from __future__ import annotations

import pytest


def test_names_bound_by_rank_0_come_back_and_equal_rank_0s_values(kernel):
    result = kernel.execute("""#pragma taas --gpus 2
import torch, torch.distributed as dist, taas
dist.init_process_group("gloo")
torch.manual_seed(taas.rank())
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(4, 3)).sum().backward()
optimizer.step()
history = [taas.rank(), 1.5]
def double(x):
    return 2 * x
class Box:
    size = 7
weights = model.module.weight.detach().clone()
print("W", weights.tolist())
""").ok()
    assert result.stderr == ""
    rank0_weights = [line for line in result.each_rank().splitlines() if line.startswith("[rank 0] W")][0].split(" W ")[
        1
    ]
    assert kernel.value("type(model).__name__") == "Linear", "DDP comes back as the module it wraps"
    assert kernel.value("history") == [0, 1.5]
    assert kernel.value("(double(4), Box.size)") == (8, 7)
    assert kernel.value("str(model.weight.detach().tolist())") == rank0_weights
    assert kernel.value("torch.equal(weights, model.weight.detach())") is True
    assert kernel.value("optimizer.param_groups[0]['params'][0] is model.weight") is True


@pytest.mark.parametrize("how", ["--return head", "--keep --return head"])
def test_a_small_view_of_a_large_tensor_comes_back_as_its_elements(kernel, how):
    """``head = big[:3]`` of 200 MB: 12 bytes come back (it was the whole storage), in a one-shot cell,
    a session's first cell and %taas pull."""
    try:
        result = kernel.execute(
            f"#pragma taas --gpus 2 {how}\nimport torch\nbig = torch.ones(50_000_000)\n"
            "head = big[:3] * 0 + big[:3]\nhead = big[:3]"
        ).ok()
        assert result.seconds < 30
        assert kernel.value("(head.tolist(), head.untyped_storage().nbytes())") == ([1.0, 1.0, 1.0], 12)
        if "--keep" in how:
            kernel.execute("del head").ok()
            kernel.execute("%taas pull head").ok()  # from every rank: a taas.PerRank
            assert kernel.value("[head[r].untyped_storage().nbytes() for r in range(2)]") == [12, 12]
    finally:
        kernel.execute("%taas stop\nhead = None").ok()


def test_return_limits_what_comes_back_and_none_turns_it_off(kernel):
    kernel.execute("#pragma taas --gpus 2 --return kept\nkept = 1\nnot_kept = 2").ok()
    assert kernel.value("('kept' in globals(), 'not_kept' in globals())") == (True, False)
    kernel.execute("#pragma taas --gpus 2 --return none\nnothing_back = 3").ok()
    assert kernel.value("'nothing_back' in globals()") is False
    result = kernel.execute("#pragma taas --gpus 2 --return missing\nx = 1").ok()
    assert result.stderr == "taas: not copied back from rank 0: missing (not bound when the cell ended)\n"


def test_a_name_bound_only_in_other_ranks_is_silently_not_copied_unless_return_asked_for_it(kernel):
    branches = "import taas\nif taas.rank() == 1:\n    only_in_1 = 1\nin_all = 2"
    result = kernel.execute("#pragma taas --gpus 2\n" + branches).ok()
    assert result.stderr == ""
    assert kernel.value("('only_in_1' in globals(), in_all)") == (False, 2)
    result = kernel.execute("#pragma taas --gpus 2 --return only_in_1,in_all\n" + branches).ok()
    assert result.stderr == "taas: not copied back from rank 0: only_in_1 (not bound when the cell ended)\n"


def test_objects_that_live_only_in_the_job_are_listed_in_one_notice_not_raised(kernel):
    result = kernel.execute("""#pragma taas --gpus 2
import threading, torch.distributed as dist
from torch.utils.data import DataLoader
dist.init_process_group("gloo")
group = dist.new_group([0, 1])
loader = DataLoader(list(range(8)), num_workers=1, persistent_workers=True)
batches = iter(loader)
first = next(batches)
lock = threading.Lock()
value = 42
""").ok()
    notices = result.stderr.splitlines()
    assert len(notices) == 1 and notices[0].startswith("taas: not copied back from rank 0: ")
    for name in ("group", "loader", "batches", "lock"):
        assert f" {name} (" in notices[0] or f": {name} (" in notices[0]
    assert kernel.value("(value, first.tolist())") == (42, [0])


def test_only_rank_0_writes_files_and_the_file_is_whole(kernel, tmp_path):
    target = tmp_path / "model.pt"
    result = kernel.execute(f"""#pragma taas --gpus 3
import torch, taas
torch.save({{"rank": taas.rank(), "data": torch.full((256, 256), float(taas.rank()))}}, {str(target)!r})
""").ok()
    assert result.stderr == (
        f"taas: torch.save to {str(target)!r} skipped in ranks 1-2: only rank 0 writes files "
        "(guard other writes with taas.is_main())\n"
    )
    import torch

    saved = torch.load(target)
    assert saved["rank"] == 0 and torch.equal(saved["data"], torch.zeros(256, 256))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"], "no temporary file remains"


def test_rank_0_saves_through_a_symlink_into_the_file_it_names_and_the_link_stays(kernel, tmp_path):
    (tmp_path / "runs").mkdir()
    link = tmp_path / "latest.pt"
    link.symlink_to("runs/model.pt")
    kernel.execute(f"#pragma taas --gpus 2\nimport torch, taas\ntorch.save(taas.rank() + 7, {str(link)!r})").ok()
    import torch

    assert link.is_symlink() and torch.load(tmp_path / "runs" / "model.pt") == 7


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_names_the_notebook_gave_to_torch_save_and_init_process_group_are_replaced_too(kernel, tmp_path, start):
    kernel.execute("from torch import save as keep\nfrom torch.distributed import init_process_group as join").ok()
    target = tmp_path / f"by_alias_{start}.pt"
    result = kernel.execute(f"""#pragma taas --gpus 2 --start {start}
import torch, taas
join("nccl", init_method="env://")  # on CPU, served by gloo through the notebook's own name too
keep({{"rank": taas.rank()}}, {str(target)!r})
torch.distributed.barrier()  # gloo's init returns in one rank while the other still connects: not gone before
torch.distributed.destroy_process_group()
""").ok()
    assert f"taas: torch.save to {str(target)!r} skipped in rank 1" in result.stderr
    assert "backend 'nccl' is served by 'gloo'" in result.stderr
    import torch

    assert torch.load(target) == {"rank": 0}


def test_the_kernel_never_initializes_cuda_by_taking_results_back(kernel):
    kernel.execute("#pragma taas --gpus 2\nimport torch\nt = torch.ones(3)").ok()
    assert kernel.value("torch.cuda.is_initialized()") is False


BAD_AND_GOOD = """
import os, socket, sys, threading, torch
sys.path.insert(0, {folder!r})
from only_in_ranks import named, anonymous  # a module the kernel cannot import

class RefusesWithSystemExit:
    def __reduce__(self):
        raise SystemExit("not today")
class Endless:
    def __reduce__(self):
        return (Endless, (), Endless())
def rebuild_in_a_rank_only():
    if "RANK" not in os.environ:
        raise RuntimeError("only a rank can rebuild this")
class RankOnly:
    def __reduce__(self):
        return (rebuild_in_a_rank_only, ())
def numbers():
    yield 1

lock = threading.Lock()
generator = numbers()
log = open(os.devnull, "w")
sock = socket.socket()
refuses = RefusesWithSystemExit()
endless = Endless()
rank_only = RankOnly()
holder = {{"inside": rank_only}}
model = torch.nn.Linear(3, 1)
big = torch.ones(4_000_000)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
value = 42
"""


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_every_name_that_cannot_come_back_is_named_in_one_line_and_the_others_come_back(kernel, tmp_path, start):
    (tmp_path / "only_in_ranks.py").write_text("def named(x):\n    return x + 1\nanonymous = lambda x: x * 2\n")
    result = kernel.execute(f"#pragma taas --gpus 2 --start {start}\n" + BAD_AND_GOOD.format(folder=str(tmp_path))).ok()
    notices = result.stderr.splitlines()
    assert len(notices) == 1 and notices[0].startswith("taas: not copied back from rank 0: "), result.stderr
    parts = [
        part.partition(" (") for part in notices[0].removeprefix("taas: not copied back from rank 0: ").split("; ")
    ]
    reasons = {name: why.removesuffix(")") for name, _, why in parts}
    assert reasons == {
        "lock": "lock cannot be pickled (TypeError: cannot pickle '_thread.lock' object)",
        "generator": "generator cannot be pickled (TypeError: cannot pickle 'generator' object)",
        "log": "TextIOWrapper cannot be pickled (PicklingError: Cannot pickle files that are not opened for "
        "reading: w)",
        "sock": "socket cannot be pickled (TypeError: cannot pickle 'socket' object)",
        "refuses": "RefusesWithSystemExit cannot be pickled (SystemExit: not today)",
        "endless": "Endless cannot be pickled (PicklingError: Could not pickle object as excessively deep recursion "
        "required.)",
        "rank_only": "could not be unpickled in the kernel (RuntimeError: only a rank can rebuild this)",
        "holder": "shares objects with rank_only, which could not be unpickled in the kernel",
        "named": "could not be unpickled in the kernel (ModuleNotFoundError: No module named 'only_in_ranks')",
    }
    assert kernel.value("(value, anonymous(4), big.shape[0], type(model).__name__)") == (42, 8, 4_000_000, "Linear")
    assert kernel.value("optimizer.param_groups[0]['params'][0] is model.weight") is True


@pytest.mark.parametrize("halt", ["time.sleep(30)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_a_rank_stopped_in_the_middle_of_a_save_leaves_no_file_behind(kernel, tmp_path, halt):
    result = kernel.execute(f"""#pragma taas --gpus 2 --timeout 2
import os, signal, time, torch
class Halts:
    def __reduce__(self):
        {halt}  # stopped by --timeout (SIGTERM), or killed
torch.save({{"w": torch.ones(1000), "halts": Halts()}}, {str(tmp_path / "model.pt")!r})
""")
    assert result.error is not None
    assert list(tmp_path.iterdir()) == []
