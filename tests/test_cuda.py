"""CUDA and NCCL: run where GPUs are visible, skipped elsewhere (CI has none)."""

from __future__ import annotations

import pytest

from conftest import Kernel
from taas_magic.machine import cuda_device_count

GPUS = cuda_device_count()
pytestmark = [pytest.mark.cuda, pytest.mark.kernel,
              pytest.mark.skipif(GPUS < 1, reason="no CUDA device visible")]


@pytest.fixture(scope="module")
def gpu_kernel():
    k = Kernel({"TAAS_DEVICE": "auto"})
    yield k
    k.shutdown()


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices")
def test_each_rank_is_bound_to_its_gpu_and_nccl_works(gpu_kernel):
    result = gpu_kernel.execute("""#pragma taas --gpus 2
import torch, torch.distributed as dist, taas
dist.init_process_group(backend="nccl", init_method="env://")
t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
print("CUDA", torch.cuda.current_device(), taas.device(), t.item(), dist.get_backend())
""", timeout=180).ok()
    assert "[rank 0] CUDA 0 cuda:0 3.0 nccl" in result.stdout
    assert "[rank 1] CUDA 1 cuda:1 3.0 nccl" in result.stdout


def test_the_kernel_never_initializes_cuda_itself(gpu_kernel):
    gpu_kernel.execute("#pragma taas --gpus 1\nimport torch\nprint(torch.zeros(1, device='cuda').device)").ok()
    assert gpu_kernel.value("torch.cuda.is_initialized()") is False


def test_forking_gpu_ranks_is_refused_once_the_kernel_used_cuda(fresh_kernel):
    fresh_kernel.execute("%env TAAS_DEVICE=auto").ok()
    fresh_kernel.execute("import torch\nx = torch.zeros(1, device='cuda')").ok()
    result = fresh_kernel.execute("#pragma taas --gpus 1 --device cuda\nprint('started')")
    assert "CUDA was already used in this kernel" in result.error["evalue"]
    assert "started" not in result.stdout
    # CPU ranks do not touch CUDA, so they may still be forked.
    assert fresh_kernel.execute("#pragma taas --gpus 2 --device cpu\nprint('cpu ok')").ok().stdout.count("cpu ok") == 2
