"""Choosing how ranks start: fork when it is safe, the fork server when the kernel has used CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
from IPython.core.error import UsageError

from taas_magic.kernel.header.spec import resolve_start


@pytest.mark.parametrize(
    "requested, device, unsafe, can_fork, expected",
    [
        ("auto", "cuda", False, True, ("fork", "")),
        ("auto", "cpu", True, True, ("forkserver", "CUDA was already used in this kernel")),
        ("auto", "cuda", True, True, ("forkserver", "CUDA was already used in this kernel")),
        ("auto", "cuda", False, False, ("forkserver", "cannot fork the kernel")),
        ("forkserver", "cuda", False, True, ("forkserver", "")),
        ("spawn", "cuda", False, True, ("forkserver", "")),  # its earlier name
        ("fork", "cpu", True, True, ("fork", "")),
    ],
)
def test_resolve_start(requested, device, unsafe, can_fork, expected):
    start, notice = resolve_start(requested, device, unsafe, can_fork)
    assert start == expected[0]
    assert (expected[1] in notice) if expected[1] else notice == ""


@pytest.mark.parametrize(
    "requested, expected",
    [
        ("auto", ("forkserver", "gRPC runs threads in this kernel")),
        ("fork", ("fork", "")),
        ("forkserver", ("forkserver", "")),
    ],
)
def test_while_grpc_runs_threads_auto_starts_from_the_fork_server(requested, expected):
    start, notice = resolve_start(requested, "cpu", False, True, grpc_threads=True)
    assert start == expected[0]
    assert (expected[1] in notice) if expected[1] else notice == ""


@pytest.mark.parametrize("can_fork, message", [(True, "CUDA was already used"), (False, "cannot fork")])
def test_fork_is_refused_where_it_cannot_work(can_fork, message):
    with pytest.raises(UsageError, match=message):
        resolve_start("fork", "cuda", True, can_fork)


def test_a_live_grpc_channel_is_seen_and_a_closed_one_is_not():
    """A channel starts grpcio's threads; they go when it closes (a fork is then clean again)."""
    probe = (
        "import grpc, time\nfrom taas_magic.process.machine import grpc_threads_in_kernel as g\n"
        "channel = grpc.insecure_channel('127.0.0.1:9')\n"
        # grpcio starts its threads, and ends them after the close, a moment later: longer on a busy machine
        "deadline = time.monotonic() + 10\n"
        "while not g() and time.monotonic() < deadline:\n    time.sleep(0.05)\n"
        "open_ = g()\nchannel.close()\n"
        "deadline = time.monotonic() + 10\n"
        "while g() and time.monotonic() < deadline:\n    time.sleep(0.05)\n"
        "print(open_, g())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False"], out.stderr


def test_asking_torch_whether_cuda_is_available_makes_forks_unable_to_use_it():
    probe = (
        "import torch\nfrom taas_magic.process.machine import fork_poisoned_for_cuda as p\n"
        "before = p()\ntorch.cuda.is_available()\nprint(before, p(), torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True", "False"], out.stderr


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("runs", [1, 3])
def test_while_runs_go_on_in_the_background_the_kernel_is_not_forked(device, runs):
    start, notice = resolve_start("auto", device, False, True, in_background=runs)
    assert start == "forkserver" and "a run in the background has threads in this kernel" in notice
    with pytest.raises(
        UsageError, match=rf"^--start fork: {runs} runs? in the background ha(s|ve) threads.*%taas wait"
    ):
        resolve_start("fork", device, False, True, in_background=runs)
    assert resolve_start("forkserver", device, False, True, in_background=runs) == ("forkserver", "")
