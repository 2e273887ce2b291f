"""CUDA and NCCL: run where GPUs are visible, skipped elsewhere (CI has none).

On a GPU machine: ``pytest -m cuda tests/e2e/kernel/test_cuda.py``. Two kernels serve the module: one
that never touches CUDA itself (the fast path: ranks forked from it), and one whose notebook
used CUDA before the taas cells (the ranks must come from the fork server).
"""

from __future__ import annotations

import gzip
import json
import math
import re
import time

import psutil
import pytest
from support.cells import NOTEBOOK, REGRESSION
from support.kernel import ANSI, CellResult, Kernel, view_rows, working_in

from taas_magic.process.machine import cuda_device_count

WARM_FORK_SERVER = True  # GPU runs start from the warm server once CUDA was used (tests/e2e/conftest.py)

GPUS = cuda_device_count()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS < 1, reason="no CUDA device visible")]

ONE_AND_ALL = sorted({1, max(GPUS, 1)})

NCCL_CELL = """#pragma taas --gpus {gpus} --device cuda
import json, os, psutil, taas, torch, torch.distributed as dist
dist.init_process_group(backend="nccl", init_method="env://")
t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
print("NCCL " + json.dumps({{"rank": dist.get_rank(), "current": torch.cuda.current_device(),
                            "device": str(taas.device()), "sum": t.item(), "backend": dist.get_backend(),
                            "ancestors": [p.pid for p in psutil.Process().parents()]}}), flush=True)
dist.destroy_process_group()
"""


def nccl_records(result: CellResult) -> dict[int, dict]:
    records = [json.loads(m) for m in re.findall(r"NCCL (\{.*\})", result.stdout)]
    return {record["rank"]: record for record in records}


def assert_nccl_worked(result: CellResult, gpus: int) -> dict[int, dict]:
    records = nccl_records(result)
    assert sorted(records) == list(range(gpus)), result.stdout + result.stderr
    for rank, record in records.items():
        assert (record["current"], record["device"], record["backend"]) == (rank, f"cuda:{rank}", "nccl")
        assert record["sum"] == gpus * (gpus + 1) / 2
    return records


@pytest.fixture(scope="module")
def gpu_kernel():
    k = Kernel({"TAAS_DEVICE": "auto"})
    yield k
    k.shutdown()


@pytest.fixture(scope="module")
def cuda_used_kernel():
    """A notebook that used CUDA itself before its taas cells: forked ranks could not."""
    k = Kernel({"TAAS_DEVICE": "auto"})
    k.execute("import torch\nx_cuda = torch.arange(4.0, device='cuda')").ok()
    yield k
    k.shutdown()


# The kernel that never touches CUDA: ranks forked from it.


def test_the_machine_description_counts_the_visible_gpus(gpu_kernel):
    assert f"CUDA devices:        {GPUS} visible" in gpu_kernel.execute("%taas").ok().stdout
    warning = gpu_kernel.execute("#!g2.8\nx_here = 1").ok().stderr
    expected = (
        ""
        if GPUS >= 8
        else f"taas: g2.8 needs 8 GPUs, this machine has {GPUS}: running the cell in the kernel anyway\n"
    )
    assert warning == expected
    result = gpu_kernel.execute(f"#pragma taas --gpus {GPUS + 1}\nprint('started')")
    assert f"--gpus {GPUS + 1} needs {GPUS + 1} CUDA devices, this machine has {GPUS}" in result.error["evalue"]
    assert "started" not in result.stdout


@pytest.mark.parametrize("gpus", ONE_AND_ALL)
def test_each_rank_is_bound_to_its_gpu_and_nccl_all_reduce_works(gpu_kernel, gpus):
    result = gpu_kernel.execute(NCCL_CELL.format(gpus=gpus), timeout=180).ok()
    records = assert_nccl_worked(result, gpus)
    server = gpu_kernel.fork_server()
    assert all(gpu_kernel.pid in r["ancestors"] for r in records.values())
    assert server is None or not any(server.pid in r["ancestors"] for r in records.values()), (
        "forked from the kernel, not started by the fork server"
    )
    assert "fork server" not in result.stderr


def test_the_kernel_never_initializes_cuda_itself(gpu_kernel):
    gpu_kernel.execute("#pragma taas --gpus 1\nimport torch\ny_cuda = torch.ones(2, device='cuda')").ok()
    assert gpu_kernel.value("torch.cuda.is_initialized()") is False
    assert gpu_kernel.value("(str(y_cuda.device), y_cuda.tolist())") == ("cpu", [1.0, 1.0]), (
        "a CUDA tensor comes back as a CPU tensor"
    )
    assert gpu_kernel.value("torch.cuda.is_initialized()") is False


# The hang doctor on NCCL: its collectives are read from NCCL's own flight recorder.
NCCL_INIT = """import time, torch, torch.distributed as dist
dist.init_process_group(backend="nccl", init_method="env://")
t = torch.ones(1024, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
"""
ALL_GPUS = f"#pragma taas --gpus {max(GPUS, 2)} --device cuda"
needs_two = pytest.mark.skipif(GPUS < 2, reason="NCCL puts one rank on each GPU: a hang needs two")


@needs_two
def test_an_nccl_rank_that_skips_a_collective_is_named_with_where_it_is(gpu_kernel):
    r = gpu_kernel.execute(
        f"{ALL_GPUS} --hang-after 5 --timeout 20\n"
        + NCCL_INIT
        + """\
if dist.get_rank() != 1:
    dist.all_reduce(t)
    torch.cuda.synchronize()
time.sleep(60)
""",
        timeout=180,
    )
    shown = ANSI.sub("", r.stderr)
    others = "rank 0" if GPUS == 2 else f"ranks 0,2-{GPUS - 1}"
    assert f"rank 1 has not entered all_reduce #2 that {others} wait" in shown and "time.sleep(60)" in shown, shown
    assert "(4.1 KB float32)" in shown
    assert r.error is not None and r.error["ename"] == "RunTimedOut"
    assert gpu_kernel.value("torch.cuda.is_initialized()") is False


@needs_two
def test_an_nccl_all_reduce_of_different_shapes_is_named_as_such(gpu_kernel):
    r = gpu_kernel.execute(
        f"{ALL_GPUS} --hang-after 5 --timeout 20\n"
        + NCCL_INIT
        + """\
size = 1000 if dist.get_rank() == 0 else 10
dist.all_reduce(torch.ones(size, device="cuda"))
torch.cuda.synchronize()
""",
        timeout=180,
    )
    shown = ANSI.sub("", r.stderr + r.traceback)
    assert "with different tensors: rank 0 with [1000] float32" in shown, shown
    assert r.error is not None


@needs_two
def test_an_interrupted_nccl_hang_shows_each_place_once_and_the_kernel_goes_on(gpu_kernel):
    r = gpu_kernel.execute(
        f"{ALL_GPUS}\n"
        + NCCL_INIT
        + """\
if dist.get_rank() == 0:
    time.sleep(600)
dist.all_reduce(t)
torch.cuda.synchronize()
""",
        timeout=180,
        interrupt_after=15,
    )
    shown = ANSI.sub("", r.traceback)
    assert "where the ranks were when interrupted:" in shown, shown
    assert shown.count("time.sleep(600)") == 1
    assert gpu_kernel.execute("print('usable')").ok().stdout == "usable\n"


@needs_two
def test_an_nccl_failure_reads_the_same_every_time_and_its_waiting_peers_are_stopped_by_it(gpu_kernel):
    """NCCL peers hang where gloo's break: either way they are stopped by the failure, never failed, and placed."""
    others = "rank 0" if GPUS == 2 else f"ranks 0,2-{GPUS - 1}"
    for _ in range(3):
        r = gpu_kernel.execute(
            f"{ALL_GPUS}\n"
            + NCCL_INIT
            + """\
if dist.get_rank() == 1:
    time.sleep(1)
    raise ValueError("bad batch")
dist.all_reduce(t)
torch.cuda.synchronize()
""",
            timeout=180,
        )
        shown = ANSI.sub("", r.traceback)
        assert r.error["evalue"] == "rank 1 failed: ValueError: bad batch", shown
        assert f"stopped after the failure: {others}" in shown and "also failed" not in shown, shown
        assert "where they were when rank 1 failed:" in shown and "all_reduce" in shown, shown
        rows = [line.split()[:3] for line in view_rows(r.displays[-1]["text/plain"])]
        assert rows == [["rank", str(rank), "failed" if rank == 1 else "stopped"] for rank in range(len(rows))], rows
    assert gpu_kernel.value("torch.cuda.is_initialized()") is False


def test_a_single_nccl_rank_asleep_is_diagnosed_without_touching_nccl_state(gpu_kernel):
    r = gpu_kernel.execute(
        "#pragma taas --gpus 1 --device cuda --hang-after 3 --timeout 10\n" + NCCL_INIT + "time.sleep(60)\n",
        timeout=180,
    )
    shown = ANSI.sub("", r.stderr)
    assert "no progress for 3 s: no rank is in a collective: rank 0 is at Cell In[" in shown, shown
    assert "time.sleep(60)" in shown and "finished #1" in shown


def test_registered_loader_with_pin_memory_delivers_pinned_batches(gpu_kernel):
    gpu_kernel.execute("""
import torch, taas
from torch.utils.data import DataLoader, TensorDataset
pinned_loader = DataLoader(TensorDataset(torch.arange(64.0).reshape(32, 2)), batch_size=4, pin_memory=True)
taas.register(pinned_loader)
""").ok()
    result = gpu_kernel.execute(
        f"""#pragma taas --gpus {GPUS} --cpus 2
import json, taas, torch
seen = []
for (x,) in pinned_loader:
    seen.append([x.is_pinned(), x.cuda(non_blocking=True).sum().item()])
torch.cuda.synchronize()
print("PINNED " + json.dumps({{"rank": taas.rank(), "seen": seen}}), flush=True)
""",
        timeout=180,
    ).ok()
    records = [json.loads(m) for m in re.findall(r"PINNED (\{.*\})", result.stdout)]
    assert sorted(r["rank"] for r in records) == list(range(GPUS))
    share = math.ceil(8 / GPUS)  # 8 batches, padded to a multiple of the ranks
    for record in records:
        assert len(record["seen"]) == share
        assert all(pinned for pinned, _ in record["seen"]), "every batch arrives in pinned memory"
    if 8 % GPUS == 0:
        assert sum(total for r in records for _, total in r["seen"]) == sum(range(64))
    ranks = f"{GPUS} rank{'s' if GPUS != 1 else ''}"
    assert f"taas: pinned_loader: {share * GPUS} elements delivered to {ranks}," in result.stderr
    assert gpu_kernel.value("torch.cuda.is_initialized()") is False


def test_lightning_trains_on_every_gpu_with_ddp_and_the_module_comes_back(gpu_kernel):
    gpu_kernel.execute(REGRESSION).ok()
    result = gpu_kernel.execute(
        f"""#pragma taas --gpus {GPUS} --return model
import json
model = Regression()
trainer = pl.Trainer(accelerator="gpu", devices={GPUS}, strategy="ddp", max_epochs=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, DataLoader(TensorDataset(X, Y), batch_size=32))
print("RESULT " + json.dumps({{"rank": trainer.global_rank, "world": trainer.world_size,
                              "root": str(trainer.strategy.root_device),
                              "weights": [round(v, 4) for v in model.layer.weight.detach().cpu().flatten().tolist()]}}))
""",
        timeout=300,
    ).ok()
    records = [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", result.stdout)]
    assert sorted(r["rank"] for r in records) == list(range(GPUS)), result.stdout + result.stderr
    assert all(r["world"] == GPUS and r["root"] == f"cuda:{r['rank']}" for r in records)
    weights = {tuple(r["weights"]) for r in records}
    assert len(weights) == 1, "DDP kept every rank's weights identical"
    # The trained module comes back with rank 0's weights, on the CPU, and the kernel's CUDA stays untouched.
    assert gpu_kernel.value("(type(model).__name__, str(model.layer.weight.device))") == ("Regression", "cpu")
    back = gpu_kernel.value("[round(v, 4) for v in model.layer.weight.detach().flatten().tolist()]")
    assert tuple(back) == weights.pop()
    assert gpu_kernel.value("torch.cuda.is_initialized()") is False


# The kernel whose notebook used CUDA: ranks from the fork server.

CUDA_STATE = "(torch.cuda.current_device(), torch.cuda.memory_allocated(), str(x_cuda.device), x_cuda.tolist())"


def test_auto_starts_from_the_fork_server_once_the_kernel_used_cuda_and_nccl_works_there(cuda_used_kernel):
    before = cuda_used_kernel.value(CUDA_STATE)
    environ = cuda_used_kernel.value("dict(os.environ)")
    result = cuda_used_kernel.execute(NCCL_CELL.format(gpus=GPUS), timeout=180).ok()
    records = assert_nccl_worked(result, GPUS)
    assert (
        "taas: CUDA was already used in this kernel, so the ranks start from the fork server (--start forkserver)\n"
        in result.stderr
    )
    server = cuda_used_kernel.fork_server()
    assert server is not None and all(server.pid in r["ancestors"] for r in records.values())
    assert cuda_used_kernel.value(CUDA_STATE) == before
    assert cuda_used_kernel.value("dict(os.environ)") == environ
    assert cuda_used_kernel.value("(x_cuda * 2).sum().item()") == 12.0, "the kernel can still use its GPU"


def test_gpu_tensors_that_are_more_than_their_elements_reach_fork_server_ranks_on_the_cpu(cuda_used_kernel):
    """They go through torch's own pickling, which would rebuild them on the GPU in the fork server, whose
    forked ranks could then not use CUDA: they cross on the CPU, with what they carry."""
    cuda_used_kernel.execute(
        "noted_cuda = torch.ones(3, device='cuda')\nnoted_cuda.note = 'kept'\n"
        "sparse_cuda = torch.eye(2, device='cuda').to_sparse()"
    ).ok()
    result = cuda_used_kernel.execute(
        f"#pragma taas --gpus {GPUS} --device cuda --start forkserver\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('nccl')\n"
        "print('GOT', noted_cuda.device, noted_cuda.note, sparse_cuda.device, sparse_cuda.to_dense().sum().item(),"
        " torch.cuda.current_device())",
        timeout=180,
    ).ok()
    # The ranks' own CUDA works (NCCL's group started): the fork server they were forked from never touched it.
    got = sorted(re.findall(r"GOT (.*)", result.stdout))
    assert got == [f"cpu kept cpu 2.0 {rank}" for rank in range(GPUS)], result.stdout


def test_forking_gpu_ranks_is_refused_once_the_kernel_used_cuda(cuda_used_kernel):
    result = cuda_used_kernel.execute("#pragma taas --gpus 1 --device cuda --start fork\nprint('started')")
    assert result.error["ename"] in ("UsageError", "TaasUsageError")
    assert result.error["evalue"].startswith("--start fork: CUDA was already used in this kernel")
    assert "started" not in result.stdout
    assert cuda_used_kernel.children() == []


def test_cpu_ranks_still_run_once_the_kernel_used_cuda(cuda_used_kernel):
    result = cuda_used_kernel.execute("#pragma taas --gpus 2 --device cpu\nprint('cpu ok')").ok()
    assert result.each_rank().count("cpu ok") == 2
    assert "the ranks start from the fork server (--start forkserver)" in result.stderr, (
        "a kernel holding a CUDA context is not forked by default, even for CPU ranks"
    )
    # An explicit --start fork is still allowed for CPU ranks, which never touch CUDA.
    result = cuda_used_kernel.execute("#pragma taas --gpus 2 --device cpu --start fork\nprint('forked ok')").ok()
    assert result.each_rank().count("forked ok") == 2


# Sessions, the live view, restarts and sharded models on CUDA: what the CPU tests check with gloo, with NCCL.

SESSION_START = """#pragma taas --gpus {gpus} --device cuda --keep --start {start}
import os, torch, torch.distributed as dist
dist.init_process_group("nccl", init_method="env://")
w = torch.full((1024,), float(dist.get_rank() + 1), device="cuda")
pid = os.getpid()
"""


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_session_keeps_its_nccl_group_and_cuda_tensors_from_cell_to_cell(gpu_kernel, start):
    gpu_kernel.execute(SESSION_START.format(gpus=GPUS, start=start), timeout=180).ok()
    try:
        first_pid = gpu_kernel.value("pid")
        r = gpu_kernel.execute(
            "#pragma taas\ndist.all_reduce(w)\ntorch.cuda.synchronize()\n"
            "total, same = w[0].item(), os.getpid() == pid\nprint('device', w.device, flush=True)",
            timeout=120,
        ).ok()
        assert gpu_kernel.value("(total, same, pid)") == (GPUS * (GPUS + 1) / 2, True, first_pid)
        shown = r.each_rank() if GPUS > 1 else f"[rank 0] {r.stdout}"  # one rank's lines carry no label
        assert all(f"[rank {rank}] device cuda:{rank}" in shown for rank in range(GPUS)), r.stdout
        assert gpu_kernel.value("(str(w.device), w.shape[0], w[0].item())") == ("cpu", 1024, GPUS * (GPUS + 1) / 2), (
            "rank 0's CUDA tensor comes back as a CPU tensor after each cell"
        )
        gpu_kernel.execute("%taas pull w --ranks 0").ok()
        assert gpu_kernel.value("(str(w.device), w[0].item())") == ("cpu", GPUS * (GPUS + 1) / 2)
        r = gpu_kernel.execute("#pragma taas\nimport time\ntime.sleep(60)", timeout=120, interrupt_after=3)
        assert r.error is not None
        again = gpu_kernel.execute(
            "#pragma taas\ndist.all_reduce(w)\ntorch.cuda.synchronize()\nafter_interrupt = w[0].item()", timeout=120
        ).ok()
        assert again.error is None and gpu_kernel.value("after_interrupt") == (GPUS * (GPUS + 1) / 2) * GPUS, (
            "the session and its NCCL group survive an interrupted cell"
        )
        assert gpu_kernel.value("torch.cuda.is_initialized()") is False
    finally:
        gpu_kernel.execute("%taas stop").ok()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(first_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(first_pid), "the session's ranks end with it"


def test_the_live_view_shows_each_ranks_gpu_memory_while_it_runs_and_its_peak_at_the_end(gpu_kernel):
    r = gpu_kernel.execute(
        f"#pragma taas --gpus {GPUS} --device cuda --return none\n"
        "import time, torch\n"
        "big = torch.empty(2 * 1024**3, dtype=torch.uint8, device='cuda')\n"
        "big.fill_(1)\ntorch.cuda.synchronize()\ntime.sleep(4)\n",
        timeout=180,
    ).ok()
    running = [d["text/plain"] for d in r.displays if "· running" in d["text/plain"].splitlines()[0]]
    gpu_rows = [m for view in running for m in re.findall(r"^rank \d +running .*· GPU ([\d.]+) GB", view, re.M)]
    assert gpu_rows and max(float(size) for size in gpu_rows) >= 2, running[-3:]
    summary = r.displays[-1]["text/plain"]
    peaks = re.findall(r"^rank \d +done +peak [\d.]+ [KMG]B · GPU ([\d.]+) GB", summary, re.M)
    assert len(peaks) == GPUS and all(float(size) >= 2 for size in peaks), summary
    assert gpu_kernel.value("torch.cuda.is_initialized()") is False


def test_a_restarted_nccl_run_starts_a_new_process_group_and_succeeds(gpu_kernel):
    r = gpu_kernel.execute(
        f"#pragma taas --gpus {GPUS} --device cuda --max-restarts 1\n"
        "import os, torch, torch.distributed as dist\n"
        "restart = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "dist.init_process_group('nccl', init_method='env://')\n"
        "t = torch.ones(1, device='cuda')\ndist.all_reduce(t)\ntorch.cuda.synchronize()\n"
        "if restart == 0 and dist.get_rank() == 0:\n"
        "    raise RuntimeError('first start fails')\n"
        "restarted_sum = (restart, t.item())\n"
        "dist.destroy_process_group()\n",
        timeout=240,
    ).ok()
    assert "taas: rank 0 failed: RuntimeError: first start fails: every rank starts again (restart 1 of " in r.stderr
    assert gpu_kernel.value("restarted_sum") == (1, float(GPUS))
    assert gpu_kernel.value("torch.cuda.is_initialized()") is False


def test_an_fsdp2_model_trained_on_gpus_comes_back_whole_on_the_cpu(gpu_kernel):
    gpu_kernel.execute(NOTEBOOK).ok()
    r = gpu_kernel.execute(
        f"%%taas --gpus {GPUS} --device cuda\n"
        """import copy, torch, torch.distributed as dist, taas
from torch.distributed.fsdp import fully_shard
dist.init_process_group("nccl", init_method="env://")
torch.set_default_device("cuda")
model = copy.deepcopy(initial).cuda()
for block in model.layers:
    fully_shard(block)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses = [train_step(model, optimizer, data[step, taas.rank()].cuda()) for step in range(3)]
torch.set_default_device("cpu")
""",
        timeout=240,
    ).ok()
    assert "Traceback" not in r.stderr, r.stderr
    assert gpu_kernel.value("[c.__name__ for c in type(model).__mro__]") == ["Transformer", "Module", "object"]
    assert gpu_kernel.value("{(type(p).__name__, str(p.device)) for p in model.parameters()}") == {("Parameter", "cpu")}
    assert gpu_kernel.value("all(torch.isfinite(p).all().item() for p in model.parameters())") is True
    assert gpu_kernel.value("not torch.equal(model.head.weight, initial.head.weight)") is True, "it trained"
    gpu_kernel.execute("train_step(model, optimizer, data[0, 0])").ok()  # it goes on training here, on the CPU
    assert gpu_kernel.value("torch.cuda.is_initialized()") is False


def test_a_kernel_whose_cuda_driver_another_library_initialized_starts_gpu_ranks_from_the_fork_server():
    """``cuInit`` outside torch (a library, an earlier cell) leaves torch.cuda.is_initialized() False, and a
    rank forked from the kernel then fails with "CUDA error: initialization error"."""
    kernel = Kernel()
    try:
        kernel.execute("import ctypes\nassert ctypes.CDLL('libcuda.so.1').cuInit(0) == 0").ok()
        assert kernel.value("torch.cuda.is_initialized()") is False
        r = kernel.execute(NCCL_CELL.format(gpus=GPUS), timeout=180).ok()
        assert_nccl_worked(r, GPUS)
    finally:
        kernel.shutdown()


def test_profile_records_each_ranks_gpu_kernels_in_rows_beside_its_own(gpu_kernel, tmp_path):
    with working_in(gpu_kernel, tmp_path):
        r = gpu_kernel.execute(
            f"#pragma taas --gpus {GPUS} --device cuda --profile\nimport torch, torch.distributed as dist\n"
            "dist.init_process_group('nccl')\nx = torch.randn(1024, 1024, device='cuda')\n"
            "for _ in range(20):\n    x = x @ x / 1024\n    dist.all_reduce(x)\ntorch.cuda.synchronize()\n",
            timeout=180,
        ).ok()
    (trace,) = tmp_path.glob("taas-profile-*.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    for rank in range(GPUS):
        assert f"rank {rank}" in rows.values(), rows
        devices = [pid for pid, name in rows.items() if name.startswith(f"rank {rank} · ")]
        kernels = {e["name"] for e in events if e["pid"] in devices and e.get("cat") == "kernel"}
        assert any("gemm" in name.lower() or "sgemm" in name.lower() for name in kernels), (rows, sorted(kernels)[:20])
    noise = [line for line in r.stderr.splitlines() if "profil" in line.lower() and "taas: --profile" not in line]
    assert not noise and f"the ranks' trace is {trace}" in r.stderr, r.stderr
