"""A taas cell in a real kernel: what each rank sees, and what the cell shows."""

from __future__ import annotations

import json
import re

from support.kernel import port_is_free, processes_of_run

TORCHRUN = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
]

ENV_CELL = (
    """#!g2.8
#pragma taas --gpus 3
import json, os, taas
print("ENV " + json.dumps({k: os.environ.get(k) for k in %r}
      | {"taas": [taas.rank(), taas.local_rank(), taas.world_size(), taas.is_main(), str(taas.device())]}))
"""
    % TORCHRUN
)


def rank_envs(result) -> dict[int, dict]:
    envs = {}
    for line in result.stdout.splitlines():
        match = re.fullmatch(r"\[rank (\d+)\] ENV (.*)", line)
        if match:
            envs[int(match[1])] = json.loads(match[2])
    return envs


def test_every_rank_gets_the_torchrun_environment_and_the_kernel_keeps_its_own(kernel):
    before = kernel.value("dict(os.environ)")
    first = rank_envs(kernel.execute(ENV_CELL).ok())
    second = rank_envs(kernel.execute(ENV_CELL).ok())
    assert sorted(first) == [0, 1, 2]
    for rank, env in first.items():
        assert all(env[name] is not None for name in TORCHRUN), env
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "3"
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
        assert env["taas"] == [rank, rank, 3, rank == 0, "cpu"]
    assert len({env["MASTER_PORT"] for env in first.values()}) == 1
    assert len({env["TORCHELASTIC_RUN_ID"] for env in first.values()}) == 1
    assert first[0]["MASTER_PORT"] != second[0]["MASTER_PORT"], "every run gets a fresh port"
    assert first[0]["TORCHELASTIC_RUN_ID"] != second[0]["TORCHELASTIC_RUN_ID"]
    assert first[0]["MASTER_PORT"] != "29500"
    assert kernel.value("dict(os.environ)") == before
    assert port_is_free(int(first[0]["MASTER_PORT"]))


def test_taas_module_outside_a_cell_answers_as_rank_0_of_1(kernel):
    assert kernel.value(
        "(taas.rank(), taas.world_size(), taas.is_main(), str(taas.device()))".replace("taas.", "__import__('taas').")
    ) == (0, 1, True, "cpu")


def test_the_notebook_namespace_is_usable_in_the_ranks(kernel):
    kernel.execute("""
import math
import torch.nn as nn
SCALE = 10
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 1)
def train(x):
    return math.floor(x * SCALE)
square = lambda v: v * v
""").ok()
    result = kernel.execute("#pragma taas --gpus 2\nprint(train(0.25), square(3), type(Net()).__name__, SCALE)").ok()
    assert sorted(result.each_rank().splitlines()) == ["[rank 0] 2 9 Net 10", "[rank 1] 2 9 Net 10"]


def test_init_process_group_env_and_a_collective_work_unchanged(kernel):
    result = kernel.execute("""#pragma taas --gpus 2
import torch, torch.distributed as dist
dist.init_process_group(backend="nccl", init_method="env://")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print("sum", t.item(), dist.get_world_size(), dist.get_backend())
dist.destroy_process_group()
""").ok()
    assert "[rank 0] sum 3.0 2 gloo" in result.each_rank() and "[rank 1] sum 3.0 2 gloo" in result.each_rank()
    assert result.stderr.count("backend 'nccl' is served by 'gloo'") == 1


def test_output_streams_live_not_at_the_end(kernel):
    result = kernel.execute("""#pragma taas --gpus 2
import time
print("early", flush=True)
time.sleep(2)
print("late")
""").ok()
    times = {text.strip(): at for name, text, at in result.streams for text in text.splitlines() if text.strip()}
    early = max(at for line, at in times.items() if line.endswith("early"))
    late = min(at for line, at in times.items() if line.endswith("late"))
    assert late - early > 1.2, result.streams


def test_every_line_arrives_in_order_with_its_rank_and_stream(kernel):
    result = kernel.execute("""#pragma taas --gpus 2
import os, subprocess, sys, taas
for i in range(3000):
    print(f"line {i}")
os.write(1, b"written to fd 1 by C-level code\\n")
subprocess.run(["sh", "-c", "echo from a child process; echo child error >&2"])
print("to stderr", file=sys.stderr)
sys.stdout.write("no newline at the end")
""").ok()
    for rank in (0, 1):
        mine = [
            line[len(f"[rank {rank}] ") :]
            for line in result.each_rank().splitlines()
            if line.startswith(f"[rank {rank}] ")
        ]
        assert mine[:3000] == [f"line {i}" for i in range(3000)]
        assert mine[3000:] == ["written to fd 1 by C-level code", "from a child process", "no newline at the end"]
        assert f"[rank {rank}] to stderr" in result.each_rank("stderr").splitlines()
        assert f"[rank {rank}] child error" in result.each_rank("stderr").splitlines()
    assert "to stderr" not in result.stdout


def test_a_print_whose_values_take_time_to_format_arrives_as_one_line(kernel):
    """``print(a, b)`` writes each value and separator on its own: a rank paused between them (a busy machine, here a
    slow ``__str__``) must not show the line in two pieces."""
    result = kernel.execute("""#pragma taas --gpus 2
import os, time
class Slow:
    def __str__(self):
        time.sleep(0.5)
        return "formatted"
print("pid", os.getpid(), Slow(), "done")
""").ok()
    for rank in (0, 1):
        (line,) = [line for line in result.each_rank().splitlines() if line.startswith(f"[rank {rank}]")]
        assert re.fullmatch(rf"\[rank {rank}\] pid \d+ formatted done", line), result.each_rank()


def test_output_rank0_shows_rank_0_alone_without_prefix(kernel):
    result = kernel.execute("#pragma taas --gpus 2 --output rank0\nimport taas\nprint('I am', taas.rank())").ok()
    assert result.stdout == "I am 0\n"


def test_a_carriage_return_progress_bar_is_drawn_in_its_row_and_ends_as_one_labelled_line(kernel):
    result = kernel.execute("""#pragma taas --gpus 2
import sys, time, taas
if taas.is_main():
    for pct in (10, 20, 30, 40):
        sys.stdout.write(f"\\rprogress {pct}%")
        sys.stdout.flush()
        time.sleep(0.4)
    sys.stdout.write("\\n")
""").ok()
    assert result.stdout == "[rank 0] progress 40%\n", "the bar's final drawing, once"
    rows = [line for view in result.displays for line in view["text/plain"].splitlines() if line.startswith("rank 0 ")]
    drawn = {row.rsplit(" ", 1)[-1] for row in rows if " progress " in row}
    assert len(drawn) >= 2, f"while it is redrawn, the bar is in its rank's row of the live view: {rows}"


def test_a_single_rank_is_not_prefixed(kernel):
    assert kernel.execute("#pragma taas\nprint('alone')").ok().stdout == "alone\n"


def test_tqdm_renders_on_rank_0(kernel):
    result = kernel.execute("""#pragma taas --gpus 2
from tqdm import tqdm
import taas, time
for _ in tqdm(range(5), disable=not taas.is_main(), mininterval=0):
    time.sleep(0.05)
""").ok()
    assert "[rank 0]" in result.stderr and "5/5" in result.stderr and "[rank 1]" not in result.stderr
    assert "\r" not in result.stderr and result.stderr.count("\n") == 1, "one line: the bar's final drawing"


def test_nothing_of_the_run_remains_after_success(kernel):
    result = kernel.execute("""#pragma taas --gpus 2
import os, torch
from torch.utils.data import DataLoader
loader = DataLoader(list(range(64)), batch_size=8, num_workers=2, persistent_workers=True)
print("RUN", os.environ["TAAS_RUN_ID"], os.environ["MASTER_PORT"], sum(int(b.sum()) for b in loader))
""").ok()
    run_id, port, total = result.stdout.splitlines()[0].split()[-3:]
    assert total == str(sum(range(64)))
    assert processes_of_run(run_id) == []
    assert port_is_free(int(port))


def test_ranks_never_talk_to_the_frontend_through_the_kernels_sockets(kernel):
    kernel.execute("import logging\nlog = logging.getLogger('taas-test')").ok()
    result = kernel.execute("""#pragma taas --gpus 2
from IPython.display import display
display({"shown": "as text"})
kernel = get_ipython().kernel
for _ in range(20):
    kernel.session.send(kernel.iopub_socket, "stream", {"name": "stdout", "text": "must not arrive"})
log.warning("through a logger made in the kernel")
""").ok()
    assert "must not arrive" not in result.stdout
    assert "[rank 0] {'shown': 'as text'}" in result.each_rank()
    assert "[rank 1] through a logger made in the kernel" in result.each_rank("stderr")
    assert kernel.execute("print('kernel ok')").ok().stdout == "kernel ok\n"
