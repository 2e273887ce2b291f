"""Data delivery in a real kernel: registered loaders served to the ranks by producer processes."""

from __future__ import annotations

import json
import re
import time

import pytest
from support.cells import GATHERED_STATE, drawn_passes, indices_loader, replicas_equal
from support.kernel import processes_of_run
from test_kernel_sessions import gone

SETUP = indices_loader("os.getpid()")  # element i is (i, pid of the process that built it)

COLLECT = """import json, os, taas
seen = []
for epoch in range(PASSES):
    batches = [b[:, 0].tolist() for b in loader]
    seen.append(batches)
print("GOT " + json.dumps({"rank": taas.rank(), "pid": os.getpid(), "len": len(loader), "passes": seen}))
"""


@pytest.fixture(scope="module")
def registered(kernel):
    kernel.execute(SETUP).ok()
    return kernel


def received(result) -> dict[int, dict]:
    found = {}
    for match in re.finditer(r"GOT (\{.*\})", result.stdout):
        record = json.loads(match[1])
        found[record["rank"]] = record
    return found


def run(kernel, options: str, passes: int = 1):
    result = kernel.execute(f"#pragma taas --gpus 2 {options}\n" + COLLECT.replace("PASSES", str(passes))).ok()
    return result, received(result)


@pytest.mark.parametrize("producers", [1, 2, 3])
def test_every_element_exactly_once_equal_counts_same_order_whatever_k(registered, producers):
    result, got = run(registered, f"--cpus {producers}", passes=2)
    _, again = run(registered, "--cpus 1", passes=2)
    assert sorted(got) == [0, 1]
    for number in range(2):
        per_rank = [[i for batch in got[rank]["passes"][number] for i in batch] for rank in (0, 1)]
        assert len(got[0]["passes"][number]) == len(got[1]["passes"][number]) == got[0]["len"] == 7
        union = per_rank[0] + per_rank[1]
        assert sorted(set(union)) == list(range(50)), "every element of the pass is delivered"
        assert len(union) == 54 and len(union) - len(set(union)) == 4, "13 batches padded to 14 with the first one"
    assert got[0]["passes"][0] != got[0]["passes"][1], "each pass is reshuffled"
    assert {r: g["passes"] for r, g in got.items()} == {r: g["passes"] for r, g in again.items()}, (
        "the same order on every run, whatever the number of producers"
    )
    assert "taas: loader: 28 elements delivered to 2 ranks" in result.stderr


def test_producers_are_processes_of_their_own(registered):
    result = registered.execute("""#pragma taas --gpus 2 --cpus 2
import json, os, taas
builders = sorted({int(pid) for _ in range(2) for batch in loader for pid in batch[:, 1].tolist()})
print("PIDS " + json.dumps([os.getpid(), os.getppid(), builders]))
""").ok()
    lines = [json.loads(line) for line in re.findall(r"PIDS (.*)", result.stdout)]
    ranks = {rank for rank, _, _ in lines}
    builders = {pid for _, _, pids in lines for pid in pids}
    assert len(builders) == 2, "two producers built the elements"
    assert not builders & (ranks | {registered.pid}), "neither the ranks nor the kernel"


def test_units_end_the_stream_at_the_right_element_across_passes(registered):
    _, got = run(registered, "--units 20", passes=3)
    sizes = [[len(p) for p in got[rank]["passes"]] for rank in (0, 1)]
    assert sizes == [[7, 4, 0], [7, 4, 0]], "13 batches, then 7 more (padded to 8), then nothing"
    second = got[0]["passes"][1] + got[1]["passes"][1]
    assert len({tuple(b) for b in second}) == 7, "the 7 units of the second pass, one of them twice"


def test_fastest_order_still_delivers_each_element_once_per_place(registered):
    _, got = run(registered, "--cpus 3 --order fastest")
    union = [i for rank in (0, 1) for batch in got[rank]["passes"][0] for i in batch]
    assert sorted(set(union)) == list(range(50)) and len(got[0]["passes"][0]) == len(got[1]["passes"][0])


def test_cpus_0_turns_delivery_off_and_an_unregistered_loader_is_untouched(registered):
    _, got = run(registered, "--cpus 0")
    assert all(sum(len(b) for b in got[rank]["passes"][0]) == 50 for rank in (0, 1)), "each rank iterates it all"
    registered.execute("taas.unregister(loader)").ok()
    try:
        result, got = run(registered, "")
        assert all(g["len"] == 13 for g in got.values())
        assert "elements delivered" not in result.stderr
    finally:
        registered.execute("taas.register(loader)").ok()
    assert registered.value("len(loader)") == 13, "outside a taas cell the loader is unchanged"


def test_a_loader_with_worker_processes_and_the_fork_server(registered):
    registered.execute("workers = DataLoader(Indices(24), batch_size=3, num_workers=2)\ntaas.register(workers)").ok()
    for start in ("fork", "forkserver"):
        result = registered.execute(f"""#pragma taas --gpus 2 --start {start}
import taas
mine = [i for batch in workers for i in batch[:, 0].tolist()]
print("MINE", sorted(mine))
""").ok()
        mine = [json.loads(m) for m in re.findall(r"MINE (\[.*\])", result.stdout)]
        assert sorted(mine[0] + mine[1]) == list(range(24)), start


def test_a_failing_dataset_fails_the_cell_naming_the_loader_and_element(registered):
    registered.execute("broken = DataLoader(Indices(40, fail_at=21), batch_size=4)\ntaas.register(broken)").ok()
    result = registered.execute(
        """#pragma taas --gpus 2
import os
print("RUN", os.environ["TAAS_RUN_ID"], flush=True) if os.environ["RANK"] == "0" else None
for batch in broken:
    pass
""",
        timeout=60,
    )
    assert result.error is not None and result.seconds < 15
    assert result.error["evalue"].startswith(
        "producer 0 of broken failed at element 5 of pass 0 (samples [20, 21, 22, 23]): "
    )
    assert "ValueError: sample 21 is corrupt" in result.error["evalue"]
    assert "raise ValueError" in result.traceback
    run_id = re.search(r"RUN (taas-\w+)", result.stdout)[1]
    assert processes_of_run(run_id) == []


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_producers_stopped_after_ranks_leave_early_print_nothing_and_leave_nothing(registered, start):
    # taas stops the producers as soon as the ranks are done: that used to interrupt their
    # DataLoader workers' shutdown, or kill the workers under them, and print it.
    registered.execute(
        "from torch.utils.data import TensorDataset\n"
        "many = DataLoader(TensorDataset(torch.arange(4000.)), batch_size=8, num_workers=2)\n"
        "taas.register(many)"
    ).ok()
    for attempt in range(4):  # a race: it showed in about one run in three
        result = registered.execute(
            f"""#pragma taas --gpus 2 --start {start}
import os
print("RUN", os.environ["TAAS_RUN_ID"], flush=True) if os.environ["RANK"] == "0" else None
for i, (b,) in enumerate(many):
    if i == 3:
        break
""",
            timeout=60,
        ).ok()
        assert "[producer" not in result.stderr, result.stderr
        assert "taas: many: 8 elements delivered to 2 ranks" in result.stderr
        assert processes_of_run(re.search(r"RUN (taas-\w+)", result.stdout)[1]) == []
    registered.execute("taas.unregister(many)").ok()


def test_a_killed_producer_is_reported_and_nothing_hangs(registered):
    registered.execute("""
import signal
class Fragile(Indices):
    def __getitem__(self, i):
        if i == 30:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)
fragile = DataLoader(Fragile(40), batch_size=4)
taas.register(fragile)
""").ok()
    result = registered.execute("#pragma taas --gpus 2\nfor batch in fragile:\n    pass", timeout=60)
    assert result.error["evalue"] == "producer 0 of fragile failed: killed by signal SIGKILL"
    assert result.seconds < 15


def test_an_interrupt_stops_ranks_and_producers(registered):
    registered.execute("""
import time
class Slow(Indices):
    def __getitem__(self, i):
        time.sleep(0.5)
        return super().__getitem__(i)
slow = DataLoader(Slow(1000), batch_size=2, num_workers=1)
taas.register(slow)
""").ok()
    result = registered.execute(
        """#pragma taas --gpus 2 --cpus 2
import os
print("RUN", os.environ["TAAS_RUN_ID"], flush=True) if os.environ["RANK"] == "0" else None
for batch in slow:
    pass
""",
        interrupt_after=3,
        timeout=30,
    )
    assert "KeyboardInterrupt" in result.traceback
    run_id = re.search(r"RUN (taas-\w+)", result.stdout)[1]
    assert processes_of_run(run_id) == []
    registered.execute("taas.unregister(slow)").ok()


def test_progress_is_shown_in_one_display_while_the_cell_runs(registered):
    registered.execute("""
class Paced(Indices):
    def __getitem__(self, i):
        time.sleep(0.02)
        return super().__getitem__(i)
paced = DataLoader(Paced(200), batch_size=2)
taas.register(paced)
""").ok()
    result = registered.execute("#pragma taas --gpus 2\nfor batch in paced:\n    pass").ok()
    shown = [d["text/plain"] for d in result.displays]
    assert len({message[1] for message in result.display_messages}) == 1, "one display, updated in place"
    rows = [line for view in shown for line in view.splitlines() if line.startswith("paced")]
    assert rows and all("produced" in row and "consumed" in row and "ready" in row for row in rows), shown
    assert shown[-1].startswith("taas: 2 ranks on cpu · done in"), "the view ends as the run's summary"
    registered.execute("taas.unregister(paced)").ok()


def test_leaving_a_pass_early_or_iterating_on_one_rank_does_not_hang(registered):
    registered.execute("few = DataLoader(torch.arange(40), batch_size=2)\ntaas.register(few)").ok()
    result = registered.execute("""#pragma taas --gpus 2 --timeout 30
first = next(iter(few))          # an iterator dropped after one element
whole = sum(1 for b in few)      # the next pass, whole
for i, b in enumerate(few):      # a pass left with break
    if i == 3:
        break
again = sum(1 for b in few)
print("COUNTS", first.tolist(), whole, again)
""").ok()
    assert "[rank 0] COUNTS [0, 1] 10 10" in result.each_rank() and "[rank 1] COUNTS [2, 3] 10 10" in result.each_rank()
    assert "taas: few: 50 elements delivered to 2 ranks" in result.stderr  # 1 + 10 + 4 + 10 per rank
    result = registered.execute(
        "#pragma taas --gpus 2 --timeout 30\nif taas.is_main():\n    print('MAIN', sum(len(b) for b in few))"
    ).ok()
    assert "[rank 0] MAIN 20" in result.each_rank(), "rank 0's share; the other rank's cell ended"
    registered.execute("taas.unregister(few)").ok()


def test_a_loader_reached_through_a_function_is_served_and_spawn_shuffles_like_fork(registered):
    registered.execute("""
torch.manual_seed(5)
shuffled = DataLoader(Indices(24), batch_size=3, shuffle=True)
taas.register(shuffled)
def consume():
    return [i for batch in shuffled for i in batch[:, 0].tolist()]
""").ok()
    orders = {}
    for start in ("fork", "forkserver"):
        result = registered.execute(f"#pragma taas --gpus 2 --start {start}\nprint('ORDER', consume())").ok()
        assert "taas: shuffled: 8 elements delivered to 2 ranks" in result.stderr, "served through consume()"
        orders[start] = sorted(re.findall(r"\[rank \d\] ORDER (.*)", result.stdout))
    assert orders["fork"] == orders["forkserver"], "the kernel's random state reaches spawned producers too"
    registered.execute("taas.unregister(shuffled)").ok()


def test_a_loader_with_its_own_generator_is_served_in_the_order_it_draws_whatever_the_start(registered):
    """A dataset of tensors, then the loader's generator: its state lies behind them in the memory file the
    fork server unpickles, which crashed the run's supervisor (``test_shipping.py`` says how)."""
    registered.execute("""
from torch.utils.data import TensorDataset
seeded = DataLoader(TensorDataset(torch.arange(24)), batch_size=3, shuffle=True,
                    generator=torch.Generator().manual_seed(7))
taas.register(seeded)
""").ok()
    drawn = registered.execute("print(torch.randperm(24, generator=torch.Generator().manual_seed(7)).tolist())").ok()
    order = json.loads(drawn.stdout)
    try:
        for start in ("fork", "forkserver"):
            result = registered.execute(
                f"#pragma taas --gpus 2 --start {start}\nprint('ORDER', [i for b in seeded for i in b[0].tolist()])"
            ).ok()
            got = {int(rank): json.loads(seen) for rank, seen in re.findall(r"\[rank (\d)\] ORDER (.*)", result.stdout)}
            batches = [order[3 * b : 3 * b + 3] for b in range(8)]
            expected = {rank: [i for batch in batches[rank::2] for i in batch] for rank in (0, 1)}
            assert got == expected, (start, result.stdout)
    finally:
        registered.execute("taas.unregister(seeded)").ok()


def test_a_rank_that_keeps_every_batch_does_not_run_out_of_descriptors(registered):
    registered.execute("many = DataLoader(torch.arange(2400), batch_size=1)\ntaas.register(many)").ok()
    result = registered.execute("""#pragma taas --gpus 2 --return none
import os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
before = len(os.listdir("/proc/self/fd"))
kept = [batch for batch in many]
mine = [int(b) for b in kept] == list(range(taas.rank(), 2400, 2))
print("KEPT", len(kept), before, len(os.listdir("/proc/self/fd")), int(mine))
""").ok()
    kept = {
        int(m[1]): tuple(map(int, m.groups()[1:]))
        for m in re.finditer(r"\[rank (\d)\] KEPT (\d+) (\d+) (\d+) (\d)", result.each_rank())
    }
    assert sorted(kept) == [0, 1], result.stdout + result.stderr
    for count, before, after, mine in kept.values():
        assert count == 1200 and mine == 1
        assert before < 200 and after <= before + 4, "descriptors stay bounded whatever the rank keeps"
    registered.execute("taas.unregister(many)").ok()


def execute_watching_progress(kernel, code: str):
    """Run a cell; also return every state its progress display showed, updates included."""
    states = []
    original = kernel.client.get_iopub_msg

    def get_iopub_msg(*args, **kwargs):
        msg = original(*args, **kwargs)
        if msg["msg_type"] in ("display_data", "update_display_data"):
            states.append(msg["content"]["data"].get("text/plain", ""))
        return msg

    kernel.client.get_iopub_msg = get_iopub_msg
    try:
        return kernel.execute(code), states
    finally:
        del kernel.client.get_iopub_msg


PROGRESS = re.compile(
    r"steps +(\w+) +(\d+) produced · (?:[\d,]+/s · )?(\d+) consumed \((\d+), (\d+) per rank\) · "
    r"(?:(\d+) skipped · )?(\d+) ready(?: · ranks waited \d+%)?(?: · (.*) finished)?$"
)


def progress(states: list[str]) -> list[tuple]:
    """The loader's row in each state of the view that has one: (produced, consumed, per rank, skipped,
    ready, finished ranks: "done" once all are)."""
    rows = [line for state in states for line in state.splitlines() if line.startswith("steps")]
    found = [PROGRESS.match(row) for row in rows]
    assert found and all(found), states
    return [
        (int(m[2]), int(m[3]), (int(m[4]), int(m[5])), int(m[6] or 0), int(m[7]), "done" if m[1] == "done" else m[8])
        for m in found
    ]


def test_the_progress_line_follows_a_rank_that_leaves_a_pass_early_to_the_end(registered):
    registered.execute("steps = DataLoader(torch.arange(40), batch_size=2)\ntaas.register(steps)").ok()
    result, states = execute_watching_progress(
        registered,
        """#pragma taas --gpus 2
for i, batch in enumerate(steps):
    if taas.rank() == 1 and i == 2:
        break
""",
    )
    result.ok()
    produced, consumed, per_rank, skipped, buffered, finished = progress(states)[-1]
    assert (consumed, per_rank, skipped, buffered, finished) == (13, (10, 3), 7, 0, "done")
    # At most the pass, and what the producers prepared of the next one while a rank could still begin it:
    # --prefetch's default of 8 elements for 2 ranks (docs/data-delivery.md). A run here showed 22.
    assert 13 <= produced <= 20 + 8
    registered.execute("taas.unregister(steps)").ok()


def test_the_progress_line_is_right_while_ranks_that_stopped_early_go_on_computing(registered):
    registered.execute("steps = DataLoader(torch.arange(40), batch_size=2)\ntaas.register(steps)").ok()
    result, states = execute_watching_progress(
        registered,
        """#pragma taas --gpus 2
import time
for i, batch in enumerate(steps):
    if i == 2:
        break
time.sleep(1.5)
""",
    )
    result.ok()
    seen = progress(states)
    assert all(consumed <= 6 for _, consumed, *_ in seen), "what a rank skipped is not counted as consumed"
    computing = [state for state in seen if state[3] == 14 and state[5] is None]
    assert computing, states
    produced, consumed, per_rank, skipped, buffered, finished = computing[-1]
    # The rest of pass 0 is skipped; pass 1 is built as far as the window allows (4 rounds of 2 ranks),
    # and an element a producer was already sending as the ranks left pass 0 may still be counted.
    assert (consumed, per_rank) == (6, (3, 3)) and buffered in (8, 9)
    assert seen[-1][1:] == (6, (3, 3), 14, 0, "done"), "at the end nothing is buffered for anyone"
    registered.execute("taas.unregister(steps)").ok()


# -- sessions: producers that live as long as the session ------------------------------------------
SESSION = """#pragma taas --gpus 2 --keep --cpus 2 --start {start}
import json, os, taas
print("RUN", os.environ["TAAS_RUN_ID"], flush=True) if taas.rank() == 0 else None
"""


def session_passes(results) -> dict[int, list]:
    """Each rank's passes over the session's cells, in order."""
    passes: dict[int, list] = {0: [], 1: []}
    for result in results:
        for rank, record in received(result).items():
            passes[rank] += record["passes"]
    return passes


def assert_each_pass_whole(passes: dict[int, list], elements: int) -> None:
    for number in range(len(passes[0])):
        union = [i for rank in (0, 1) for batch in passes[rank][number] for i in batch]
        assert sorted(set(union)) == list(range(elements)), f"pass {number}: every element, each once per place"
        assert len(passes[0][number]) == len(passes[1][number]), "every rank gets the same number of elements"


def leftovers(pids: set[int]) -> list[str]:
    """Processes of ``pids`` still alive, and the temporary folders their DataLoaders made (``pymp-taas-PID-*``)."""
    import glob
    import tempfile

    import psutil

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # gone, even between two questions about it
            return False

    alive = [f"pid {pid}" for pid in pids if running(pid)]
    return alive + [folder for pid in pids for folder in glob.glob(f"{tempfile.gettempdir()}/pymp-taas-{pid}-*")]


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_session_serves_a_registered_loader_pass_after_pass_as_a_one_shot_cell_would(registered, start):
    _, one_shot = run(registered, "--cpus 2", passes=3)
    first = registered.execute(SESSION.format(start=start)).ok()
    run_id = re.search(r"RUN (taas-\w+)", first.stdout)[1]
    try:
        cells = [
            registered.execute("#pragma taas\n" + COLLECT.replace("PASSES", str(passes))).ok() for passes in (2, 1)
        ]
        assert "taas: loader: 28 elements delivered to 2 ranks" in cells[0].stderr
        assert "taas: loader: 14 elements delivered to 2 ranks" in cells[1].stderr, "each cell sums up its own"
        assert all(record["len"] == 7 for result in cells for record in received(result).values())
        passes = session_passes(cells)
        assert_each_pass_whole(passes, 50)
        assert passes == {rank: record["passes"] for rank, record in one_shot.items()}, (
            "the session's passes are a one-shot cell's, in the same order"
        )
        built = registered.execute("""#pragma taas
print("BUILT", json.dumps(sorted({pid for batch in loader for pid in batch[:, 1].tolist()})))
""").ok()
        builders = {pid for found in re.findall(r"BUILT (.*)", built.stdout) for pid in json.loads(found)}
        assert len(builders) == 2 and not builders & {record["pid"] for record in received(cells[0]).values()}
    finally:
        registered.execute("%taas stop").ok()
    assert processes_of_run(run_id) == []
    assert leftovers(builders) == [], "no producer, and nothing it made, outlives the session"


def test_an_interrupted_session_cell_leaves_the_next_pass_whole_and_in_order(registered):
    registered.execute("""
class Paced(Indices):
    def __getitem__(self, i):
        time.sleep(0.02)
        return super().__getitem__(i)
paced = DataLoader(Paced(300), batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(3))
taas.register(paced)
""").ok()
    reference = registered.execute("""#pragma taas --gpus 2 --cpus 2
import json, taas
print("PASSES " + json.dumps([[b[0, 0].item() for b in paced] for _ in range(2)]))
""").ok()
    expected = {
        int(rank): json.loads(found) for rank, found in re.findall(r"\[rank (\d)\] PASSES (.*)", reference.each_rank())
    }
    registered.execute(SESSION.format(start="fork")).ok()
    try:
        interrupted = registered.execute(
            """#pragma taas
import json
took = []
try:
    for batch in paced:
        took.append(batch[0, 0].item())
finally:
    print("TOOK " + json.dumps(took), flush=True)
""",
            interrupt_after=2.0,
            timeout=60,
        )
        assert interrupted.error["evalue"].startswith("KeyboardInterrupt: taas interrupted the cell"), interrupted.error
        took = {
            int(rank): json.loads(found)
            for rank, found in re.findall(r"\[rank (\d)\] TOOK (.*)", interrupted.each_rank())
        }
        assert all(0 < len(took[rank]) < 150 for rank in (0, 1)), "interrupted in the middle of the pass"
        assert all(took[rank] == expected[rank][0][: len(took[rank])] for rank in (0, 1)), "in order until then"
        after = registered.execute(
            """#pragma taas
import json
print("NEXT " + json.dumps([b[0, 0].item() for b in paced]))
""",
            timeout=60,
        ).ok()
        following = {
            int(rank): json.loads(found) for rank, found in re.findall(r"\[rank (\d)\] NEXT (.*)", after.each_rank())
        }
        assert following == {rank: expected[rank][1] for rank in (0, 1)}, "the next pass, whole, in its order"
        assert "taas: paced: 300 elements delivered to 2 ranks" in after.stderr, (
            "the cell's own, not the interrupted one's"
        )
    finally:
        registered.execute("%taas stop").ok()
        registered.execute("taas.unregister(paced)").ok()


LATE = """#pragma taas
import json, taas
print("LATE " + json.dumps([[b[:, 0].tolist() for b in late] for _ in range(PASSES)]))
"""


def late_passes(result) -> dict[int, list]:
    return {int(rank): json.loads(found) for rank, found in re.findall(r"\[rank (\d)\] LATE (.*)", result.each_rank())}


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_loader_registered_during_a_session_is_served_from_the_next_cell_on(registered, start):
    registered.execute("late = DataLoader(Indices(30), batch_size=3, shuffle=True)\ntaas.register(late)").ok()
    reference = late_passes(
        registered.execute(LATE.replace("PASSES", "3").replace("#pragma taas", "#pragma taas --gpus 2 --cpus 2")).ok()
    )
    registered.execute("taas.unregister(late)").ok()
    first = registered.execute(SESSION.format(start=start)).ok()
    run_id = re.search(r"RUN (taas-\w+)", first.stdout)[1]
    try:
        registered.execute("taas.register(late)").ok()
        cells = [registered.execute(LATE.replace("PASSES", str(passes))).ok() for passes in (1, 2)]
        assert "taas: late: 10 elements delivered to 2 ranks" in cells[0].stderr
        got = {rank: late_passes(cells[0])[rank] + late_passes(cells[1])[rank] for rank in (0, 1)}
        assert got == reference, "served from the cell that first used it, as a one-shot cell serves it"
        registered.execute("""
class Later(Indices):
    def __getitem__(self, i):
        return super().__getitem__(i) + torch.tensor([1000, 0])
fresh = DataLoader(Later(10), batch_size=2)
taas.register(fresh)
""").ok()
        result = registered.execute(
            "#pragma taas\nimport json\nprint('FRESH ' + json.dumps([b[:, 0].tolist() for b in fresh]), len(fresh))"
        ).ok()
        found = [json.loads(part) for part in re.findall(r"FRESH (\[.*\]) 3", result.stdout)]
        assert sorted(i for part in found for batch in part for i in batch) == sorted(
            list(range(1000, 1010)) + [1000, 1001]
        ), "a loader of a class defined during the session: 5 batches padded to 6, each element once per place"
        part = registered.execute("#pragma taas --ranks 0\nprint(len(loader))")
        assert part.error["evalue"].startswith("--ranks 0: the cell uses 'loader', which producers serve to every rank")
        registered.execute("late = DataLoader(Indices(12), batch_size=3)\ntaas.register(late)").ok()
        rebound = late_passes(registered.execute(LATE.replace("PASSES", "2")).ok())
        assert rebound == {0: [[[0, 1, 2], [6, 7, 8]]] * 2, 1: [[[3, 4, 5], [9, 10, 11]]] * 2}, (
            "a name rebound to another registered loader is served as that loader"
        )
        _, got_loader = run(registered, "", passes=1)
        assert all(record["len"] == 7 for record in got_loader.values()), "the session goes on, serving its loaders"
    finally:
        registered.execute("%taas stop").ok()
        registered.execute(
            "for name in ('late', 'fresh'):\n"
            "    if any(loader is globals().get(name) for loader in taas.registered()):\n"
            "        taas.unregister(globals()[name])"
        ).ok()
    assert processes_of_run(run_id) == []


def test_a_failing_dataset_in_a_session_fails_the_cell_naming_the_element_and_ends_the_session(registered):
    registered.execute("unsound = DataLoader(Indices(40, fail_at=21), batch_size=4)\ntaas.register(unsound)").ok()
    try:
        first = registered.execute(SESSION.format(start="fork")).ok()
        run_id = re.search(r"RUN (taas-\w+)", first.stdout)[1]
        result = registered.execute("#pragma taas\nfor batch in unsound:\n    pass", timeout=60)
        assert result.error["evalue"].startswith(
            "producer 1 of unsound failed at element 5 of pass 0 (samples [20, 21, 22, 23]): ValueError: sample 21"
        )
        assert result.error["evalue"].endswith("; the session ended"), result.error["evalue"]
        assert "raise ValueError" in result.traceback and result.seconds < 15
        assert processes_of_run(run_id) == []
        shown = registered.execute("%taas").ok().stdout
        assert "session:             ended: producer 1 of unsound cannot serve its loader any more" in shown, shown
    finally:
        registered.execute("%taas stop").ok()
        registered.execute("taas.unregister(unsound)").ok()


def test_units_in_a_session_end_its_stream_across_cells_and_the_session_goes_on(registered):
    registered.execute(SESSION.format(start="fork").replace("--cpus 2", "--cpus 2 --units 20")).ok()
    try:
        cells = [
            registered.execute("#pragma taas\n" + COLLECT.replace("PASSES", str(passes))).ok() for passes in (1, 2)
        ]
        sizes = {rank: [len(p) for p in passes] for rank, passes in session_passes(cells).items()}
        assert sizes == {0: [7, 4, 0], 1: [7, 4, 0]}, "13 batches, then 7 more (padded to 8), then nothing"
        assert registered.execute("#pragma taas\nprint('still', len(loader))").ok(), (
            "producers that finished end nothing"
        )
    finally:
        registered.execute("%taas stop").ok()


def test_a_kernel_restart_ends_a_sessions_producers(fresh_kernel):
    fresh_kernel.execute(SETUP).ok()
    fresh_kernel.execute(SESSION.format(start="fork")).ok()
    built = fresh_kernel.execute(
        "#pragma taas\nimport json\n"
        "print('BUILT', os.getpid(), json.dumps(sorted({pid for b in loader for pid in b[:, 1].tolist()})))"
    ).ok()
    found = re.findall(r"BUILT (\d+) (\[.*\])", built.stdout)
    ranks, builders = {int(pid) for pid, _ in found}, {pid for _, pids in found for pid in json.loads(pids)}
    assert len(builders) == 2 and not builders & ranks, "the session's producers built the elements"
    fresh_kernel.manager.restart_kernel(now=True)
    deadline = time.monotonic() + 3
    while leftovers(builders | ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(builders | ranks) == [], "a session's producers are gone within 3 s of the kernel's death"


DRAWN = """
class Drawn(Indices):  # element i: (i, a number drawn as it is built: the same wherever it is built)
    def __getitem__(self, i):
        return torch.tensor([i, torch.randint(0, 10**6, ()).item()])
drawn = DataLoader(Drawn(60), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5))
taas.register(drawn)
"""


@pytest.fixture(scope="module")
def drawn_expected(registered) -> dict[int, dict[int, list]]:
    """What a one-shot run of 2 and of 3 ranks gives each rank of ``drawn`` in its first three passes."""
    registered.execute(DRAWN).ok()
    expected = {}
    try:
        for world in (2, 3):
            reference = registered.execute(f"""#pragma taas --gpus {world} --cpus 2
import json
print("PASSES " + json.dumps([[b.tolist() for b in drawn] for _ in range(3)]))
""").ok()
            expected[world] = drawn_passes(reference, "PASSES")
    finally:
        registered.execute("taas.unregister(drawn)").ok()
    return expected


TAKE_PASS = """#pragma taas
took = []
try:
    for b in drawn:
        took.append(b.tolist())
        if taas.rank() == 2 and len(took) == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)
finally:
    print("TOOK " + json.dumps(took), flush=True)
print("PID", os.getpid(), flush=True)
if taas.rank() == 2 and {after}:
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("moment", ["mid-pass", "after-the-pass", "between-cells"])
def test_a_rank_that_dies_in_a_session_is_replaced_and_takes_over_its_share_of_the_stream(
    registered, drawn_expected, moment
):
    """The new process goes on at the pass the others go on with, its elements the ones a one-shot run gives:
    those the dead process had received (producers run ahead of the ranks, into the next pass) are built again in
    it, the same samples under the same seeds."""
    import psutil

    expected = drawn_expected[3]
    registered.execute(DRAWN).ok()
    registered.execute("#pragma taas --gpus 3 --keep --cpus 2\nimport json, os, signal, taas").ok()
    try:
        cell = TAKE_PASS.format(kill_at=4 if moment == "mid-pass" else -1, after=moment == "after-the-pass")
        first = registered.execute(cell, timeout=60)
        took = drawn_passes(first, "TOOK")
        assert all(took[rank] == expected[rank][0][: len(took[rank])] for rank in took), "in order until then"
        if moment == "between-cells":
            first.ok()
            pid = int(re.search(r"\[rank 2\] PID (\d+)", first.each_rank())[1])
            psutil.Process(pid).kill()
            assert gone([pid], 5)
            told = "taas: rank 2 killed by signal SIGKILL between cells"
            deadline = time.monotonic() + 10  # its supervisor reaps it and tells the kernel: a moment on a busy machine
            while told not in (shown := registered.execute("%taas").ok()).stderr and time.monotonic() < deadline:
                time.sleep(0.2)
            assert told in shown.stderr, shown.stderr
        else:
            assert first.error is not None and "rank 2 failed: killed by signal SIGKILL" in first.error["evalue"]
        after = registered.execute(
            """#pragma taas
print("NEXT " + json.dumps([[b.tolist() for b in drawn] for _ in range(2)]))
""",
            timeout=60,
        ).ok()
        healing = first if moment != "between-cells" else after
        assert "[rank 2] taas: rank 2: its share of 'drawn' goes on at pass 1" in healing.each_rank("stderr")
        assert drawn_passes(after, "NEXT") == {rank: expected[rank][1:3] for rank in range(3)}, (
            "every rank, the new one too, gets the passes a one-shot run gives, element for element"
        )
    finally:
        registered.execute("%taas stop").ok()
        registered.execute("taas.unregister(drawn)").ok()


def test_a_resized_session_serves_its_loaders_anew_from_the_next_pass(registered, drawn_expected):
    """Each pass after a resize is shared among the new number of ranks as a one-shot run of that size shares it."""
    expected = drawn_expected
    registered.execute(DRAWN).ok()
    one_pass = """#pragma taas
print("PASS " + json.dumps([len(drawn), [b.tolist() for b in drawn]]))
"""
    registered.execute("#pragma taas --gpus 2 --keep --cpus 2\nimport json, os, taas").ok()
    try:
        first = drawn_passes(registered.execute(one_pass).ok(), "PASS")
        assert first == {rank: [15, expected[2][rank][0]] for rank in range(2)}
        assert "the session has 3 ranks now" in registered.execute("%taas resize 3").ok().stdout
        grown = drawn_passes(registered.execute(one_pass, timeout=60).ok(), "PASS")
        assert grown == {rank: [10, expected[3][rank][1]] for rank in range(3)}, "pass 1 among 3 ranks"
        assert "the session has 2 ranks now" in registered.execute("%taas resize 2").ok().stdout
        shrunk = drawn_passes(registered.execute(one_pass, timeout=60).ok(), "PASS")
        assert shrunk == {rank: [15, expected[2][rank][2]] for rank in range(2)}, "pass 2 among 2 again"
    finally:
        registered.execute("%taas stop").ok()
        registered.execute("taas.unregister(drawn)").ok()


def test_ddp_training_on_a_served_loader_survives_a_killed_rank_with_equal_replicas_and_the_right_batches(
    registered, drawn_expected
):
    """The session's use as it is meant: DDP training over a registered loader, a rank killed in the middle; the
    next pass trains every rank, the new one too, on the batches a one-shot run gives, with equal replicas."""
    expected = drawn_expected[3]
    registered.execute(DRAWN).ok()
    registered.execute("""#pragma taas --gpus 3 --keep --cpus 2
import json, os, signal, torch, taas
import torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
steps = 0
""").ok()
    train = (
        """#pragma taas
took = []
for b in drawn:
    took.append(b.tolist())
    model((b.float() / 1e6)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    steps += 1
    if taas.rank() == 1 and steps == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
print("TOOK " + json.dumps(took), flush=True)
"""
        + GATHERED_STATE
    )
    try:
        died = registered.execute(train.replace("KILL_AT", "6"), timeout=60)
        assert died.error is not None and "rank 1 failed: killed by signal SIGKILL" in died.error["evalue"]
        assert "taas: the session goes on, a new process in place of rank 1" in died.traceback, died.traceback
        assert "not copied (set them again in this rank): b, took" in died.stderr, "the notebook's classes are copied"
        after = registered.execute(train.replace("KILL_AT", "-1"), timeout=60).ok()
        assert drawn_passes(after, "TOOK") == {rank: expected[rank][1] for rank in range(3)}, "pass 1, whole"
        assert replicas_equal(after), after.stdout
    finally:
        registered.execute("%taas stop").ok()
        registered.execute("taas.unregister(drawn)").ok()


def test_a_late_loader_in_a_forkserver_session_goes_through_a_resize_and_a_death_with_its_stream_whole(registered):
    """The features together: a session started through the fork server, a loader registered while it runs,
    `%taas resize 3`, then a rank killed in the middle of a pass: each next pass is a one-shot run's of its size."""
    registered.execute(DRAWN).ok()
    registered.execute(
        "later = DataLoader(Drawn(36), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(9))"
    ).ok()
    both = """#pragma taas --gpus {world} --cpus 2
import json
print("PASSES " + json.dumps([[[b.tolist() for b in loader] for _ in range(3)] for loader in (drawn, later)]))
"""
    expected = {}
    for world in (2, 3):
        registered.execute("taas.register(later)").ok()
        expected[world] = drawn_passes(registered.execute(both.format(world=world)).ok(), "PASSES")
        registered.execute("taas.unregister(later)").ok()
    one_pass = """#pragma taas
took = {"drawn": [], "later": []}
try:
    for name, loader in (("drawn", drawn), ("later", later)):
        for b in loader:
            took[name].append(b.tolist())
            if taas.rank() == 1 and DIES and name == "later" and len(took[name]) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
finally:
    print("TOOK " + json.dumps([took["drawn"], took["later"]]), flush=True)
"""
    registered.execute(
        "#pragma taas --gpus 2 --keep --cpus 2 --start forkserver\n"
        "import json, os, signal, taas\nimport torch.distributed as dist\ndist.init_process_group('gloo')"
    ).ok()
    try:
        registered.execute("taas.register(later)").ok()
        first = drawn_passes(registered.execute(one_pass.replace("DIES", "False"), timeout=60).ok(), "TOOK")
        assert first == {rank: [expected[2][rank][0][0], expected[2][rank][1][0]] for rank in range(2)}
        assert "the session has 3 ranks now" in registered.execute("%taas resize 3").ok().stdout
        died = registered.execute(one_pass.replace("DIES", "True"), timeout=60)
        assert died.error is not None and "rank 1 failed: killed by signal SIGKILL" in died.error["evalue"]
        took = drawn_passes(died, "TOOK")
        assert all(took[rank][0] == expected[3][rank][0][1] for rank in took), "drawn's pass 1, among 3 ranks"
        last = drawn_passes(registered.execute(one_pass.replace("DIES", "False"), timeout=60).ok(), "TOOK")
        assert last == {rank: [expected[3][rank][0][2], expected[3][rank][1][2]] for rank in range(3)}, (
            "drawn's pass 2 and later's pass 2 (its pass 1 was cut by the death), among 3 ranks, the new rank's too"
        )
    finally:
        registered.execute("%taas stop").ok()
        registered.execute("taas.unregister(drawn)\ntaas.unregister(later)").ok()
