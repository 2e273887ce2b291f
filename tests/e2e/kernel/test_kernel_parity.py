"""A rank behaves as it would under torchrun, whether forked from the kernel or from the fork server.

Random state of its own, `exit()` that ends it, the notebook's torch settings, Accelerate's view
of the run.
"""

from __future__ import annotations

import json
import re

import pytest

DRAWS = """import json, random, numpy, torch, taas
print("DRAWS " + json.dumps({"rank": taas.rank(), "torch": torch.rand(2).tolist(), "random": random.random(),
                             "numpy": numpy.random.rand(2).tolist(), "dropout": torch.nn.functional.dropout(
                                 torch.ones(16), 0.5).tolist()}))
"""


def draws(kernel, start: str, prelude: str = "") -> dict[int, dict]:
    result = kernel.execute(f"#pragma taas --gpus 2 --start {start}\n{prelude}{DRAWS}").ok()
    found = {}
    for match in re.finditer(r"DRAWS (\{.*\})", result.stdout):
        record = json.loads(match[1])
        found[record.pop("rank")] = record
    assert sorted(found) == [0, 1], result.stdout
    return found


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_ranks_draw_their_own_numbers_and_a_rerun_draws_new_ones(kernel, start):
    first, second = draws(kernel, start), draws(kernel, start)
    for library in ("torch", "random", "numpy", "dropout"):
        assert first[0][library] != first[1][library], f"{library}: every rank has a random state of its own"
        assert first[0][library] != second[0][library], f"{library}: a re-run draws new numbers"


def test_a_seeded_notebook_replays_and_fork_and_spawn_draw_the_same(kernel):
    kernel.execute("torch.manual_seed(7)").ok()
    forked = draws(kernel, "fork")
    kernel.execute("torch.manual_seed(7)").ok()
    again = draws(kernel, "fork")
    kernel.execute("torch.manual_seed(7)").ok()
    spawned = draws(kernel, "spawn")  # the fork server by its earlier name
    assert forked == again, "a notebook seeded at its top gives the same numbers when run again"
    assert forked == spawned, "the same base seed gives the same per-rank streams, forked or spawned"


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_cell_that_seeds_itself_gets_what_it_asked_for_in_every_rank(kernel, start):
    seeds = "import random, numpy\ntorch.manual_seed(0); random.seed(0); numpy.random.seed(0)\n"
    got = draws(kernel, start, prelude=seeds)
    assert got[0] == got[1]
    expected = kernel.value("(torch.manual_seed(0), torch.rand(2).tolist())[1]")
    assert got[0]["torch"] == expected


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_exit_and_quit_end_a_rank_like_sys_exit(kernel, start):
    # `%time` makes the cell use IPython syntax: a spawned rank then has an IPython shell of its own.
    result = kernel.execute(
        f"""#pragma taas --gpus 3 --start {start}
import taas
%time pass
if taas.rank() == 1:
    exit()
if taas.rank() == 2:
    quit()
print("went on", taas.rank())
""",
        timeout=30,
    ).ok()
    assert "[rank 0] went on 0" in result.each_rank()
    assert "went on 1" not in result.stdout and "went on 2" not in result.stdout
    failed = kernel.execute(
        f"#pragma taas --gpus 2 --start {start}\nimport taas\n%time pass\nexit(3 if taas.rank() == 1 else 0)\n",
        timeout=30,
    )
    assert failed.error["evalue"] == "rank 1 failed: SystemExit: the cell called sys.exit(3)"
    assert "exit(3 if taas.rank() == 1 else 0)" in failed.traceback and "worker.py" not in failed.traceback


SETTINGS = """import torch
print("SETTINGS", [torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                   torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, str(torch.get_default_dtype()),
                   torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
                   torch.backends.cudnn.allow_tf32, torch.cuda.is_initialized(), torch.is_grad_enabled(),
                   torch.is_anomaly_enabled(), str(torch.tensor([1.23456]))])
"""


def test_torch_settings_made_in_the_kernel_hold_in_forked_and_spawned_ranks(kernel):
    defaults = kernel.execute(SETTINGS).ok().stdout
    kernel.execute("""torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cudnn.benchmark = True
torch.backends.cudnn.deterministic = True
torch.set_default_dtype(torch.float64)
torch.set_float32_matmul_precision("medium")
torch.backends.cudnn.allow_tf32 = False
torch.set_grad_enabled(False)
torch.autograd.set_detect_anomaly(True)
torch.set_printoptions(precision=2)
""").ok()
    try:
        changed = kernel.execute(SETTINGS).ok().stdout
        assert changed != defaults
        for start in ("fork", "forkserver"):
            result = kernel.execute(f"#pragma taas --gpus 2 --start {start}\n{SETTINGS}").ok()
            assert result.each_rank().count(f"] {changed}") == 2, (start, changed, result.stdout)
    finally:
        kernel.execute("""torch.use_deterministic_algorithms(False)
torch.backends.cudnn.benchmark = torch.backends.cudnn.deterministic = False
torch.set_default_dtype(torch.float32)
torch.set_float32_matmul_precision("highest")
torch.backends.cudnn.allow_tf32 = True
torch.set_grad_enabled(True)
torch.autograd.set_detect_anomaly(False)
torch.set_printoptions(profile="default")
""").ok()
    assert kernel.execute(SETTINGS).ok().stdout == defaults
    result = kernel.execute(f"#pragma taas --gpus 2 --start forkserver\n{SETTINGS}").ok()
    assert result.each_rank().count(f"] {defaults}") == 2, "the fork server kept none of the earlier run's settings"


def test_accelerate_sees_the_distributed_cpu_run(kernel):
    pytest.importorskip("accelerate")
    result = kernel.execute(
        """#pragma taas --gpus 2
from accelerate import Accelerator
accelerator = Accelerator()
print("ACCELERATE", accelerator.num_processes, accelerator.process_index, accelerator.distributed_type.name,
      accelerator.device.type)
""",
        timeout=60,
    ).ok()
    for rank in (0, 1):
        assert f"[rank {rank}] ACCELERATE 2 {rank} MULTI_CPU cpu" in result.stdout, result.stdout


def test_the_base_seed_is_drawn_on_the_cpu_whatever_the_notebooks_default_device(kernel):
    """With torch.set_default_device("cuda") in the kernel, a draw on the default device would start CUDA there."""
    kernel.execute('torch.set_default_device("meta")').ok()  # on this machine: a device that cannot give a number
    try:
        result = kernel.execute("#pragma taas --gpus 2 --start fork\nprint('went')")
    finally:
        kernel.execute("torch.set_default_device(None)").ok()
    assert result.ok().each_rank().count("] went") == 2
