"""Runs in the background (``--background``) in a real kernel: the cell returns at once with a handle, the notebook
runs other cells while the ranks train, the run's output and live view go on arriving in its own cell, and its names
join the notebook between cells; a stop, a failure, an interrupt of a wait and the kernel's shutdown leave nothing.
"""

from __future__ import annotations

import re
import time

import psutil
import pytest
from support.kernel import Kernel, still_running, working_in

TRAINING = """#pragma taas --gpus 2 --background --return losses,weights
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
torch.manual_seed(0)
data, target = torch.randn(64, 8), torch.randn(64, 1)
losses = []
for step in range({seconds} * 100):  # about 100 steps a second; DDP's ranks take the same number of steps
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(data), target)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    if len(losses) % 50 == 0:
        print("step", len(losses), flush=True)
    time.sleep(0.005)
dist.barrier()
weights = model.module.weight.detach().clone()
"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    yield k
    k.shutdown()


def run_processes(kernel: Kernel) -> list[psutil.Process]:
    return kernel.children()


def test_a_run_trains_in_the_background_while_other_cells_run_and_its_names_come_back(kernel):
    started = kernel.execute(TRAINING.format(seconds=8), timeout=60).ok()
    assert started.seconds < 10, "the cell returns as the run starts, not when it ends"
    assert re.fullmatch(
        r"taas run \d+ \(cell In\[\d+\], 2 ranks on cpu\): running for \d+ s", started.displays[-1]["text/plain"]
    ), started.displays
    assert f"(cell In[{started.reply['execution_count']}]," in started.displays[-1]["text/plain"], "the cell's number"
    handle = kernel.execute("handle = _\nprint(handle.done())").ok()
    assert handle.stdout == "False\n"

    others = [kernel.execute(f"numbers = [n * n for n in range({i} * 1000)]\nprint(len(numbers))") for i in range(10)]
    assert [r.ok().stdout for r in others] == [f"{i * 1000}\n" for i in range(10)]
    listed = kernel.execute("%taas runs").ok().stdout
    assert re.search(r"^taas: run \d+ \(cell In\[\d+\], 2 ranks on cpu\): (running for|ended after) \d+ s", listed)
    assert kernel.value("'losses' in globals()") is False, "no name changes while the run goes on"

    waited = kernel.execute("%taas wait", timeout=90).ok()
    assert re.search(r"ended after \d+ s; losses, weights back in the notebook", waited.stderr), waited.stderr
    assert kernel.value("len(losses) > 50 and losses[-1] < losses[0]") is True
    assert kernel.value("handle.done() and handle.result['weights'].shape == (1, 8)") is True

    later = kernel.later[started.msg_id]
    kinds = [kind for kind, _ in later.display_messages]
    assert kinds[0] == "display_data" and set(kinds[1:]) == {"update_display_data"}, kinds
    assert len({display_id for _, display_id in later.display_messages}) == 1, "one view, updated in place"
    assert later.displays[-1]["text/plain"].startswith("taas: 2 ranks on cpu · done in "), later.displays[-1]
    assert "step 50" in later.stdout, "the ranks' output goes to the run's own cell"
    assert not any("step 50" in r.stdout for r in others), "and to no other cell"
    assert not still_running(run_processes(kernel), timeout=10), "nothing of the run is left"


def test_a_cell_that_captures_its_output_while_a_run_goes_on_captures_none_of_the_runs(kernel):
    started = kernel.execute(TRAINING.format(seconds=6), timeout=60).ok()
    kernel.execute("run = _").ok()
    captured = kernel.execute("%%capture cap\nimport time\nprint('mine')\ntime.sleep(3)", timeout=30).ok()
    assert captured.stdout == "" and not captured.displays, "the capturing cell shows nothing of its own"
    assert kernel.value("cap.stdout") == "mine\n", "it captured its own output, and none of the run's"
    assert kernel.value("len(cap.outputs)") == 0, "nor the run's view"
    kernel.execute("run.wait(60)").ok()
    later = kernel.later[started.msg_id]
    steps = re.findall(r"^\[ranks 0-1\] step (\d+)$", later.stdout, re.MULTILINE)
    assert steps == [str(n) for n in range(50, 601, 50)], "every line of the run in its own cell"
    kinds = [kind for kind, _ in later.display_messages]
    assert kinds[0] == "display_data" and set(kinds[1:]) == {"update_display_data"} and len(kinds) > 3, kinds
    assert later.displays[-1]["text/plain"].startswith("taas: 2 ranks on cpu · done in "), later.displays[-1]


def test_an_interrupted_wait_leaves_the_run_going_and_stop_ends_it_leaving_nothing(kernel):
    kernel.execute(TRAINING.format(seconds=120), timeout=60).ok()
    kernel.execute("long = _").ok()
    waited = kernel.execute("long.wait()", interrupt_after=2, timeout=60)
    assert waited.error is not None and waited.error["ename"] == "KeyboardInterrupt"
    assert kernel.value("long.done()") is False, "an interrupt of the wait is not one of the run"
    assert run_processes(kernel), "the ranks go on"

    began = time.monotonic()
    stopped = kernel.execute("long.stop()\nprint(long)", timeout=60).ok()
    assert time.monotonic() - began < 20
    assert re.fullmatch(r"<taas run \d+ \(cell In\[\d+\], 2 ranks on cpu\): stopped after \d+ s>\n", stopped.stdout)
    assert not still_running(run_processes(kernel), timeout=10)


def test_a_failing_run_says_so_in_its_cell_on_its_handle_and_before_the_next_cell(kernel):
    failing = kernel.execute(
        "#pragma taas --gpus 2 --background\nimport os, time\ntime.sleep(1)\n"
        "if os.environ['RANK'] == '1':\n    raise ValueError('rank one gave up')\ntime.sleep(30)\n",
        timeout=60,
    ).ok()
    kernel.execute("failed = _\nfailed.wait(60)").ok()
    raised = kernel.execute("failed.result")
    assert raised.error is not None and "rank one gave up" in raised.traceback
    told = r"^taas: run \d+ \(cell In\[\d+\], 2 ranks on cpu\): failed after \d+ s: .*rank 1.*"
    assert re.search(told, raised.stderr), "said before the first cell after it ended"
    assert not kernel.execute("print('next')").ok().stderr, "and once"
    assert "ValueError: rank one gave up" in kernel.later[failing.msg_id].stderr
    assert not still_running(run_processes(kernel), timeout=10)


def test_taas_cells_run_in_the_foreground_while_a_timed_run_goes_on_in_the_background(kernel):
    timed = kernel.execute(
        "#pragma taas --gpus 2 --background --timeout 6\nimport time\nwhile True:\n    time.sleep(0.1)\n", timeout=60
    ).ok()
    kernel.execute("timed = _").ok()
    for i in range(3):
        r = kernel.execute(f"#pragma taas --gpus 2 --return rank\nimport os\nrank = int(os.environ['RANK']) + {i}", 90)
        assert r.ok() and kernel.value("rank") == i
        if i == 0:  # the kernel is not forked while the run's threads go on in it
            assert "the ranks start from the fork server" in r.stderr, r.stderr
    kernel.execute("timed.wait(60)").ok()
    said = kernel.later[timed.msg_id]
    assert "--timeout 6 s elapsed" in said.stderr, said.stderr
    assert said.displays[-1]["text/plain"].startswith("taas: 2 ranks on cpu · timed out"), said.displays[-1]
    assert not still_running(run_processes(kernel), timeout=10)


SESSION_TRAINING = """#pragma taas --background --return losses
for step in range({seconds} * 100):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(data), target)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    time.sleep(0.005)
"""


def test_a_session_cell_trains_in_the_background_and_the_session_waits_for_it(kernel):
    kernel.execute(
        "#pragma taas --gpus 2 --keep --return none\n" + TRAINING.split("\n", 1)[1].split("for step in")[0], timeout=90
    ).ok()
    started = kernel.execute(SESSION_TRAINING.format(seconds=20), timeout=60).ok()
    assert re.fullmatch(
        r"taas run \d+ \(cell In\[\d+\], 2 ranks of the session\): running for \d+ s",
        started.displays[-1]["text/plain"],
    )
    kernel.execute("training = _").ok()
    assert kernel.execute("print(sum(range(10)))").ok().stdout == "45\n", "the notebook's own cells run"
    seen = 0
    for i in range(4):  # looking into the training: every rank at the same step, equal replicas, and on it goes
        assert kernel.execute(f"print(sum(range({i})))").ok().stdout == f"{sum(range(i))}\n"
        kernel.execute("%taas pull losses model", timeout=60).ok()
        steps = kernel.value("[len(losses[0]), len(losses[1])]")
        same = kernel.value("bool((model[0].weight == model[1].weight).all())")
        assert steps[0] == steps[1] > seen and same is True, (steps, same)
        assert kernel.value("training.done()") is False, "the cell trains on"
        seen = steps[0]
    where = kernel.execute("%taas stacks", timeout=60).ok().stdout
    cell = f"Cell In[{started.reply['execution_count']}]"
    assert where.startswith("rank") and cell in where and "waiting for the next cell" not in where, (
        f"the training cell's lines: {where}"
    )
    assert kernel.value("training.done()") is False, "and the cell trains on"
    refused = kernel.execute("#pragma taas\nprint(1)")
    assert refused.error is not None and re.search(
        r"did not run: the session is running cell In\[\d+\] in the background \(run \d+\); %taas wait waits for "
        r"it, %taas stop stops it$",
        refused.error["evalue"],
    ), refused.error
    assert "running cell In[" in kernel.execute("%taas").ok().stdout
    kernel.execute("%taas wait", timeout=90).ok()
    assert kernel.value("len(losses) > 50 and losses[-1] < losses[0]") is True
    later = kernel.execute(SESSION_TRAINING.format(seconds=2).replace(" --background", ""), timeout=90).ok()
    assert later.displays[-1]["text/plain"].startswith("taas: 2 ranks on cpu · done"), "the same session trains on"

    stopped = kernel.execute(SESSION_TRAINING.format(seconds=120), timeout=60).ok()
    kernel.execute("stopping = _").ok()
    time.sleep(2)  # past the step the first cell's first pull was answered at
    kernel.execute("%taas pull losses", timeout=60).ok()
    lengths = kernel.value("[len(losses[0]), len(losses[1])]")
    assert lengths[0] == lengths[1], f"a later cell's pull is answered at a step of its own: {lengths}"
    kernel.execute("stopping.stop()").ok()
    assert kernel.value("stopping.done()") is True
    said = kernel.later[stopped.msg_id]
    assert "the session goes on" in said.stderr, said.stderr
    kernel.execute("#pragma taas\nassert len(losses) > 0", timeout=90).ok()
    kernel.execute("%taas stop").ok()
    assert not still_running(run_processes(kernel), timeout=10)


def test_a_run_in_the_background_restarts_profiles_and_outlives_a_reload_of_the_extension(kernel, tmp_path):
    """What a cell in the foreground has, in the background: --max-restarts starts it again, --profile's trace is
    written and named in its cell, even while another cell captures its own output (``%%capture``), and %reload_ext
    (the session, the cluster and the runs go on) keeps the run."""
    cell = (
        "#pragma taas --gpus 2 --background --max-restarts 1 --profile --return restarted\n"
        "import os, time, torch\n"
        "restarted = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "torch.ones(64, 64) @ torch.ones(64, 64)\n"
        "time.sleep(3)\n"
        "if restarted == 0 and os.environ['RANK'] == '1':\n"
        "    raise RuntimeError('first try')\n"
        "time.sleep(3)\n"
    )
    with working_in(kernel, tmp_path):
        started = kernel.execute(cell, timeout=60).ok()
        kernel.execute("restarting = _\n%reload_ext taas_magic").ok()
        kernel.execute("%%capture cap\nrestarting.wait(120)", timeout=150).ok()
        assert "taas-profile-" not in kernel.value("cap.stderr"), "the run's lines stay out of the capturing cell"
        kernel.execute("%taas wait", timeout=120).ok()
        assert kernel.value("restarted") == 1 and kernel.value("restarting.done()") is True
    said = kernel.later[started.msg_id]
    assert "every rank starts again (restart 1 of --max-restarts 1)" in said.stderr, said.stderr
    assert "taas-profile-" in said.stderr and list(tmp_path.glob("taas-profile-*.json.gz")), said.stderr
    assert not still_running(run_processes(kernel), timeout=10)


def test_a_run_in_the_background_is_served_its_registered_loader_and_says_where_it_hangs(kernel):
    """Data delivery and the hang doctor, in the background: the producers serve the ranks, and a hang's diagnosis
    goes to the run's own cell."""
    kernel.execute(
        "import taas, torch\nfrom torch.utils.data import DataLoader\n"
        "numbers = DataLoader(list(range(40)), batch_size=4)\ntaas.register(numbers)"
    ).ok()
    try:
        served = kernel.execute(
            "#pragma taas --gpus 2 --cpus 1 --background --return seen,late --from 0,1 --hang-after 3\n"
            "import os, time, torch.distributed as dist\n"
            "seen = sorted(int(i) for batch in numbers for i in batch)\n"
            "dist.init_process_group('gloo')\n"
            "if dist.get_rank() == 1:\n    time.sleep(8)\n"
            "dist.barrier()\nlate = True\n",
            timeout=60,
        ).ok()
        kernel.execute("%taas wait", timeout=90).ok()
        assert kernel.value("sorted(seen[0] + seen[1])") == list(range(40)), "each element once, to one rank"
        said = kernel.later[served.msg_id]
        assert "taas: no progress for" in said.stderr and "barrier" in said.stderr, said.stderr
    finally:
        kernel.execute("taas.unregister(numbers)").ok()
    assert not still_running(run_processes(kernel), timeout=10)


def test_a_pull_that_no_step_answers_waits_for_the_cell_and_takes_the_names_as_it_left_them(kernel):
    kernel.execute(
        "#pragma taas --gpus 2 --keep --return none\nimport time, torch\n"
        "weight = torch.nn.Parameter(torch.ones(2))\nopt = torch.optim.SGD([weight], lr=0.1)"
    ).ok()
    kernel.execute(
        "#pragma taas --background\nweight.sum().backward()\nopt.step()\ntime.sleep(4)\nfinished = 'yes'\n",
        timeout=60,
    ).ok()
    time.sleep(1)  # the cell has taken its one step: the pull waits for another, which never comes
    pulled = kernel.execute("%taas pull finished", timeout=60).ok()
    assert kernel.value("[finished[0], finished[1]]") == ["yes", "yes"], pulled.stderr
    kernel.execute("%taas stop").ok()


def test_a_rank_that_dies_in_a_session_cell_in_the_background_is_replaced_and_the_session_goes_on(kernel):
    # A new rank is given what the others hold alike, over their process group: three ranks, two survivors to compare
    kernel.execute(
        "#pragma taas --gpus 3 --keep --return none\nimport os, signal, time, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\nbeats = 0"
    ).ok()
    dying = kernel.execute(
        "#pragma taas --background\nfor _ in range(20):\n    beats += 1\n    time.sleep(0.1)\n"
        "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n",
        timeout=60,
    ).ok()
    kernel.execute("dying = _\ndying.wait(60)").ok()
    said = kernel.later[dying.msg_id]
    assert "rank 1" in said.stderr and "SIGKILL" in said.stderr, said.stderr
    healed = kernel.execute("#pragma taas --return beats --from 0-2\nbeats += 1", timeout=90).ok()
    assert kernel.value("[beats[0], beats[1], beats[2]]") == [21, 21, 21], healed.stderr
    kernel.execute("%taas stop").ok()


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ("--keep", "--background runs a one-shot cell, or a cell in a running session: start the session"),
        ("--debug", "--debug keeps a failing rank paused for %taas debug"),
        ("--start fork", "--background starts its ranks from the fork server"),
    ],
)
def test_what_a_run_in_the_background_cannot_honour_is_refused_before_anything_starts(kernel, options, refusal):
    r = kernel.execute(f"#pragma taas --gpus 2 --background {options}\nprint('ran')")
    assert r.error is not None and refusal in r.error["evalue"] and "\n" not in r.error["evalue"]
    assert "ran" not in r.stdout and not still_running(run_processes(kernel), timeout=10)


def test_the_kernels_shutdown_ends_a_run_in_the_background_and_leaves_nothing():
    own = Kernel()
    try:
        own.execute(TRAINING.format(seconds=120), timeout=60).ok()
        deadline = time.monotonic() + 30
        while len(own.children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        everything = psutil.Process(own.pid).children(recursive=True)
        assert len(everything) >= 3, "the fork server, the run's supervisor and its ranks"
    finally:
        own.shutdown()
    assert not still_running(everything, timeout=15)
