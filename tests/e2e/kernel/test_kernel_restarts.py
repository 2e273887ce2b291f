"""--max-restarts: a run whose rank failed starts again, as under torchrun's elastic agent."""

from __future__ import annotations

import re
import time

import pytest

# Rank 1 crashes at step 2 on the first start and at step 4 on the second; rank 0 saves a
# checkpoint after every step all ranks finished, and every start resumes from it.
RESUMING = """#pragma taas --gpus 2 --max-restarts 2 --start {start}
import os, torch, torch.distributed as dist
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
step = torch.load(CKPT)["step"] if os.path.exists(CKPT) else 0
print("start", restart, "of", os.environ["TORCHELASTIC_MAX_RESTARTS"], "from step", step,
      os.environ["TORCHELASTIC_RUN_ID"], flush=True)
dist.init_process_group("gloo")
for step in range(step, 6):
    if step == 2 * (restart + 1) and restart < 2 and dist.get_rank() == 1:
        raise RuntimeError(f"crash at step {{step}}")
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save({{"step": step + 1}}, CKPT)
finished_at = step
dist.destroy_process_group()
"""


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_run_that_checkpoints_survives_its_crashes_and_ends_where_it_should(kernel, tmp_path, start):
    kernel.execute(f"CKPT = {str(tmp_path / 'ckpt.pt')!r}").ok()
    r = kernel.execute(RESUMING.format(start=start), timeout=120).ok()
    starts = re.findall(r"\[rank 0\] start (\d) of (\d) from step (\d) (\S+)", r.each_rank())
    assert [(s[0], s[1], s[2]) for s in starts] == [("0", "2", "0"), ("1", "2", "2"), ("2", "2", "4")], r.stdout
    assert len({s[3] for s in starts}) == 1, "TORCHELASTIC_RUN_ID stays the same across restarts, as under torchrun"
    assert (
        "taas: rank 1 failed: RuntimeError: crash at step 2: every rank starts again (restart 1 of "
        "--max-restarts 2)" in r.stderr
    )
    assert "crash at step 4: every rank starts again (restart 2 of --max-restarts 2)" in r.stderr
    assert kernel.value("finished_at") == 5, "rank 0's names come from the run that succeeded"


def test_when_the_restarts_are_spent_the_cell_fails_with_the_last_failure(kernel):
    r = kernel.execute(
        "#pragma taas --gpus 2 --max-restarts 1\nimport os\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise ValueError('bad start ' + os.environ['TORCHELASTIC_RESTART_COUNT'])\n",
        timeout=60,
    )
    assert r.error is not None and r.error["evalue"] == "rank 1 failed: ValueError: bad start 1", r.error
    assert r.stderr.count("every rank starts again") == 1
    assert "taas: --max-restarts 1 spent: the cell fails with the last failure" in r.stderr


def test_with_debug_only_the_last_starts_failed_rank_is_paused_and_said(kernel):
    r = kernel.execute(
        "#pragma taas --gpus 2 --max-restarts 2 --debug\nimport os\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise ValueError('bad start ' + os.environ['TORCHELASTIC_RESTART_COUNT'])\n",
        timeout=60,
    )
    assert r.error["evalue"] == "rank 1 failed: ValueError: bad start 2", r.error
    assert r.stderr.count("every rank starts again") == 2, r.stderr
    assert r.stderr.count("is paused at its error") == 1, "earlier starts' paused ranks are gone: none is promised"
    deadline = time.monotonic() + 5  # an earlier start's rank may still be ending (reaped by the kernel)
    while len(kernel.children()) > 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(kernel.children()) == 2, "the paused rank and its supervisor, no earlier start's"
    debugged = kernel.execute("%taas debug 1", answers=["p os.environ['TORCHELASTIC_RESTART_COUNT']", "q"], timeout=30)
    assert "[rank 1] '2'" in debugged.stdout, debugged.stdout
    deadline = time.monotonic() + 5  # leaving the debugger ends the run: its supervisor is reaped a moment later
    while kernel.children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kernel.children() == [], "leaving the debugger ends the run"


def test_an_interrupt_or_a_timeout_is_never_restarted(kernel):
    r = kernel.execute(
        "#pragma taas --gpus 2 --max-restarts 3\nimport time\ntime.sleep(60)", timeout=60, interrupt_after=2.0
    )
    assert r.error is not None and "KeyboardInterrupt" in r.traceback
    assert "starts again" not in r.stderr
    r = kernel.execute("#pragma taas --gpus 2 --max-restarts 3 --timeout 2\nimport time\ntime.sleep(60)", timeout=60)
    assert r.error is not None and "--timeout 2 s elapsed" in r.error["evalue"]
    assert "starts again" not in r.stderr and r.seconds < 15


def test_a_rank_that_fails_after_the_timeout_began_counting_does_not_get_more_time(kernel):
    """--timeout counts from the cell's start, across restarts."""
    r = kernel.execute(
        "#pragma taas --gpus 2 --max-restarts 5 --timeout 3\nimport os, time\n"
        "time.sleep(1)\nraise RuntimeError('again')",
        timeout=60,
    )
    assert r.error is not None and "--timeout 3 s elapsed" in r.error["evalue"], r.error
    assert r.seconds < 10


@pytest.mark.parametrize(
    "value, message",
    [
        ("101", "argument --max-restarts: 101 is out of range: use 0-100"),
        ("-1", "argument --max-restarts: -1 is out of range: use 0-100"),
        ("two", "argument --max-restarts: 'two' is not a whole number: use 0-100"),
    ],
)
def test_a_bad_restart_count_is_one_line(kernel, value, message):
    r = kernel.execute(f"#pragma taas --gpus 2 --max-restarts {value}\nprint('never')")
    assert r.error is not None and r.error["evalue"] == message, r.error
    assert "never" not in r.stdout
