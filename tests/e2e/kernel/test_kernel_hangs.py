"""The hang doctor in a real kernel: `--hang-after`, and where the ranks are when a run times out, is
interrupted, or fails while its other ranks wait.

Each test makes one kind of hang on purpose, with a small `--hang-after` and a `--timeout` (or an
interrupt) that ends it soon after, and asserts what a person reads: the one-line cause, which ranks
are shown together, the innermost line of their own code, and that the kernel goes on working.
What gloo does with mismatched collectives is part of what a user sees, so those tests say it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import pytest
from support.kernel import ANSI, ranks_in

MOSTLY_WAITS = True  # for hangs to be seen and timeouts to end them (tests/conftest.py)

HEADER = re.compile(
    r"^(?P<who>(?:ranks? [\d,-]+|producer \d+ of \w+)(?:; (?:ranks? [\d,-]+|producer \d+ of \w+))*)"
    r"(?:: (?P<doing>.+?))?(?P<colon>:)?$"
)  # a producer's header says no more than who it is
ENDED = re.compile(r"had finished the cell|exited |failed \(|was killed by |is still running|had left")
CELL_FRAME = re.compile(r"^    Cell In\[\d+\], line (?P<line>\d+) in (?P<function>\S+)$")
FOOTER = (
    "taas: the run goes on: wait, or interrupt the cell to stop it (said after --hang-after {:g} s without "
    "progress; --hang-after 0 turns this off)"
)


@dataclass
class Place:
    """One place some processes are, as the grouped stacks show it: who is there, what they do (seconds
    shown as N), and the stack printed once for all of them."""

    ranks: set[int]
    others: list[str]
    doing: str
    stack: list[str] = field(default_factory=list)
    shares_next: bool = False  # its header had no colon: the stack below the next header may be its own too

    @property
    def at(self) -> tuple[int, str, str] | None:
        """The innermost frame of the notebook's code: (line, function, its source), or None."""
        for index, line in enumerate(self.stack):
            found = CELL_FRAME.match(line)
            if found:
                source = self.stack[index + 1].strip() if index + 1 < len(self.stack) else ""
                return int(found["line"]), found["function"], source
        return None


def ranks_of(who: str) -> tuple[set[int], list[str]]:
    ranks: set[int] = set()
    others = []
    for part in who.split("; "):
        found = re.fullmatch(r"ranks? ([\d,-]+)", part)
        if not found:
            others.append(part)
            continue
        ranks |= ranks_in(found[1])
    return ranks, others


def seconds_hidden(doing: str) -> str:
    return re.sub(r"for \d+ s\b", "for N s", doing)


def places(lines: list[str]) -> list[Place]:
    """The grouped stacks at the start of ``lines``, one ``Place`` per header. Processes with one stack but
    doing different things have a header each, the stack below the last: each of them gets that stack here."""
    found: list[Place] = []
    for line in lines:
        header = HEADER.match(line)
        if header:
            ranks, others = ranks_of(header["who"])
            found.append(Place(ranks, others, seconds_hidden(header["doing"] or ""), shares_next=not header["colon"]))
        elif line.startswith("    ") and found:
            found[-1].stack.append(line)
        else:
            break
    for place, below in reversed(list(zip(found, found[1:]))):
        if place.shares_next and not place.stack and not ENDED.match(place.doing):
            place.stack = below.stack
    return found


@dataclass
class Diagnosis:
    cause: str  # the first line, without its "taas: no progress for N s: "
    stalled: int  # the N
    places: list[Place]
    footer: str
    count: int  # how many diagnoses the cell printed


def diagnosis(result) -> Diagnosis:
    """The watchdog's message in the cell's stderr (the first one, if it spoke more than once)."""
    text = ANSI.sub("", result.stderr)
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("taas: no progress for ")]
    assert starts, f"no diagnosis in stderr:\n{text}"
    first = re.fullmatch(r"taas: no progress for (\d+) s: (.*)", lines[starts[0]])
    body = lines[starts[0] + 1 :]
    end = next(i for i, line in enumerate(body) if line.startswith("taas: the run goes on"))
    return Diagnosis(first[2], int(first[1]), places(body[:end]), body[end], len(starts))


def where(result, title: str) -> list[Place]:
    """The grouped stacks that follow ``title`` in the cell's error."""
    lines = result.traceback.splitlines()
    assert title in lines, f"no {title!r} in:\n{result.traceback}"
    return places(lines[lines.index(title) + 1 :])


def place_of(found: list[Place], ranks: set[int]) -> Place:
    matching = [p for p in found if p.ranks == ranks]
    assert len(matching) == 1, f"ranks {sorted(ranks)} are not shown together, once: {found}"
    return matching[0]


def no_diagnosis(result) -> None:
    assert "no progress" not in result.stderr, ANSI.sub("", result.stderr)


def assert_usable(kernel) -> None:
    """The kernel runs a taas cell after the hang, and nothing of the hung run is left (the fixture checks)."""
    assert kernel.execute("#pragma taas --gpus 2\nprint('next')", timeout=30).ok().each_rank().count("] next") == 2


# -- 1. a rank skips a barrier ---------------------------------------------------------------------------
def test_a_rank_that_skipped_a_barrier_and_sleeps_is_named_with_its_line(kernel):
    result = kernel.execute(
        """#pragma taas --gpus 4 --hang-after 2 --timeout 10
import time, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() != 3:
    dist.barrier()
time.sleep(30)
""",
        timeout=40,
    )
    hang = diagnosis(result)
    assert re.fullmatch(
        r"rank 3 has not entered barrier #2 that ranks 0-2 wait in; it is at Cell In\[\d+\], line 7 "
        r"\(time\.sleep\(30\)\)",
        hang.cause,
    ), hang.cause
    assert hang.count == 1, "said once per stall"
    assert hang.footer == FOOTER.format(2)
    assert re.match(r"\x1b\[0;31m\x1b\[1mtaas: no progress for \d+ s: ", result.stderr), (
        "the first line is red and bold"
    )
    assert [sorted(p.ranks) for p in hang.places] == [[0, 1, 2], [3]]
    waiting, late = hang.places
    assert waiting.doing == "in barrier #2 for N s" and waiting.at == (6, "<module>", "dist.barrier()")
    assert re.fullmatch(
        r"    in barrier \(torch/distributed/distributed_c10d\.py, line \d+\), called from:", waiting.stack[0]
    ), waiting.stack
    assert late.doing == "finished #1, in no collective" and late.at == (7, "<module>", "time.sleep(30)")
    assert "taas_magic" not in result.stderr and "site-packages" not in result.stderr

    assert result.error["ename"] == "RunTimedOut"
    timed_out = where(result, "where the processes were when the time ran out:")
    assert [(sorted(p.ranks), p.doing, p.at) for p in timed_out] == [
        ([0, 1, 2], "in barrier #2 for N s", (6, "<module>", "dist.barrier()")),
        ([3], "finished #1, in no collective", (7, "<module>", "time.sleep(30)")),
    ]
    assert_usable(kernel)


@pytest.mark.timing
def test_a_rank_that_skipped_a_barrier_and_finished_its_cell_breaks_its_peers_at_once(kernel):
    # In a one-shot run, a rank that finished its cell exits, and gloo tells its peers at once: they fail
    # (the connection to rank 3 is reset) before any watchdog could speak.
    result = kernel.execute(
        """#pragma taas --gpus 4 --hang-after 2 --timeout 10
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() != 3:
    dist.barrier()
""",
        timeout=40,
    )
    assert result.error["ename"] == "RankFailed" and result.seconds < 5
    assert re.fullmatch(
        r"rank [0-2] failed: RuntimeError: .*Connection (reset|closed) by peer.*", result.error["evalue"]
    )
    assert re.search(r"before rank [0-2] failed: rank 3 had finished the cell", result.traceback), result.traceback
    no_diagnosis(result)
    assert_usable(kernel)


def test_in_a_session_a_rank_that_finished_its_cell_is_named_as_such(kernel):
    kernel.execute(
        "#pragma taas --gpus 4 --keep\nimport threading, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\nmine = dist.get_rank()",
        timeout=60,
    ).ok()
    try:
        result = kernel.execute(
            """#pragma taas --hang-after 2 --timeout 20
if mine == 3:
    threading.Timer(5, dist.barrier).start()  # rank 3's cell ends; it joins the barrier 5 s later
else:
    dist.barrier()
""",
            timeout=40,
        ).ok()
        hang = diagnosis(result)
        assert hang.cause == "rank 3 has not entered barrier #1 that ranks 0-2 wait in; it had finished the cell"
        assert [(sorted(p.ranks), p.doing, p.at) for p in hang.places] == [
            ([0, 1, 2], "in barrier #1 for N s", (5, "<module>", "dist.barrier()")),
            ([3], "had finished the cell", None),
        ]
        assert kernel.execute("#pragma taas\ndist.barrier()\nprint('after', mine)").ok().each_rank().count("after") == 4
    finally:
        kernel.execute("%taas stop").ok()


# -- 2, 3. mismatched collectives ----------------------------------------------------------------------------
def test_different_collectives_at_the_same_number_hang_in_gloo_and_are_named(kernel):
    result = kernel.execute(
        """#pragma taas --gpus 4 --hang-after 2 --timeout 10
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(10)
if dist.get_rank() < 2:
    dist.all_reduce(t)
else:
    dist.broadcast(t, src=0)
""",
        timeout=40,
    )
    hang = diagnosis(result)
    assert (
        hang.cause == "the ranks called different collectives: ranks 0-1 are in all_reduce #1 and ranks 2-3 are in "
        "broadcast #1"
    )
    assert [(sorted(p.ranks), p.doing, p.at) for p in hang.places] == [
        ([0, 1], "in all_reduce #1 (40 B float32) for N s", (6, "<module>", "dist.all_reduce(t)")),
        ([2, 3], "in broadcast #1 (40 B float32) for N s", (8, "<module>", "dist.broadcast(t, src=0)")),
    ]
    assert result.error["ename"] == "RunTimedOut"
    assert [sorted(p.ranks) for p in where(result, "where the processes were when the time ran out:")] == [
        [0, 1],
        [2, 3],
    ]
    assert_usable(kernel)


@pytest.mark.timing
def test_an_all_reduce_of_different_sizes_aborts_a_rank_in_gloo_instead_of_hanging(kernel):
    # gloo checks the size of what it receives: the rank that gets rank 0's 1000 floats where it expects 10
    # aborts (SIGABRT), so the user sees a failure, never "the ranks call all_reduce #1 with different tensors".
    result = kernel.execute(
        """#pragma taas --gpus 4 --hang-after 2 --timeout 10
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1000 if dist.get_rank() == 0 else 10)
dist.all_reduce(t)
""",
        timeout=40,
    )
    assert result.error["ename"] == "RankFailed" and result.seconds < 5
    assert re.fullmatch(r"rank [0-3] failed: killed by signal SIGABRT", result.error["evalue"]), result.error["evalue"]
    assert re.search(r"last lines rank [0-3] wrote to stderr:", result.traceback)
    assert (
        "Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?"
        in result.traceback
    )
    no_diagnosis(result)
    assert_usable(kernel)


# -- 4. a data loader that stops delivering -----------------------------------------------------------------
STALLING = """import time, torch, taas
from torch.utils.data import DataLoader, Dataset
class Stalls(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        if i >= 6:
            time.sleep(3600)
        return torch.tensor([i])
stalling = DataLoader(Stalls(), batch_size=1)
taas.register(stalling)
"""


def test_every_rank_waiting_for_a_stuck_loader_is_said_with_the_producers_line(kernel):
    kernel.execute(STALLING).ok()
    try:
        result = kernel.execute(
            "#pragma taas --gpus 2 --cpus 1 --hang-after 2 --timeout 10\nfor batch in stalling:\n    pass\n", timeout=40
        )
    finally:
        kernel.execute("taas.unregister(stalling)").ok()
    hang = diagnosis(result)
    assert re.fullmatch(r"every rank waits for data from stalling: its producers sent nothing for \d+ s", hang.cause)
    assert [(sorted(p.ranks), p.others) for p in hang.places] == [([0, 1], []), ([], ["producer 0 of stalling"])]
    ranks, producer = hang.places
    assert producer.doing == "", "a producer's stack says what it does"
    assert ranks.doing == "waiting for data from stalling for N s"
    assert ranks.at == (2, "<module>", "for batch in stalling:")
    assert producer.at == (8, "__getitem__", "time.sleep(3600)"), "the dataset's own line, in the producer"
    assert result.error["ename"] == "RunTimedOut"
    assert "ranks 0-1; producer 0 of stalling still running" in result.error["evalue"]
    assert_usable(kernel)


# -- 5. process-group setup that cannot complete -------------------------------------------------------------
SETUP_HANG = """#pragma taas --gpus 4 --hang-after 2 --timeout 10
import os, sys, torch.distributed as dist
if int(os.environ["RANK"]) == 3:
    {leave}
dist.init_process_group("gloo")
"""


@pytest.mark.parametrize(
    "leave, said",
    [("os._exit(0)", "exited with code 0"), ("sys.exit(0)", "exited early with sys.exit(0)")],
    ids=["os._exit", "sys.exit"],
)
def test_setup_waiting_for_a_rank_that_left_names_the_store_the_rank_and_the_line(kernel, leave, said):
    result = kernel.execute(SETUP_HANG.format(leave=leave), timeout=40)
    hang = diagnosis(result)
    assert re.fullmatch(
        rf"ranks 0-2 wait in process-group setup at the store 127\.0\.0\.1:\d+ for rank 3, which has "
        rf"not joined: it {re.escape(said)}",
        hang.cause,
    ), hang.cause
    assert [(sorted(p.ranks), p.doing) for p in hang.places] == [
        ([0, 1, 2], "in process-group setup for N s"),
        ([3], said),
    ]
    waiting = hang.places[0]
    assert waiting.at == (5, "<module>", 'dist.init_process_group("gloo")'), waiting.stack
    assert re.fullmatch(
        r"    in \w+ \(torch/distributed/distributed_c10d\.py, line \d+\), called from:", waiting.stack[0]
    ), waiting.stack
    assert result.error["ename"] == "RunTimedOut"
    assert f"before the time ran out: rank 3 {said}" in result.traceback
    assert_usable(kernel)


# -- 6, 7. no false alarm ----------------------------------------------------------------------------------
def test_a_straggler_that_is_slow_but_moving_is_no_hang(kernel):
    result = kernel.execute(
        """#pragma taas --gpus 4 --hang-after 2 --timeout 30
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
for step in range(10):  # 5 s in all: 2.5 times --hang-after
    if dist.get_rank() == 1:
        time.sleep(0.5)
    dist.all_reduce(torch.ones(1))
print("steps done")
""",
        timeout=60,
    ).ok()
    assert result.each_rank().count("steps done") == 4 and result.seconds > 5
    no_diagnosis(result)


@pytest.fixture
def busy_machine(kernel):
    """Three busy processes per core, started by the kernel: a rank that computes gets under a third of a core,
    as on a shared machine or with more ranks (and DataLoader workers) than cores. (Linux shares the CPU
    between sessions first: busy processes of the test's own session would not slow the kernel's ranks.)"""
    kernel.execute(
        "import os, subprocess, sys\n"
        "hogs = [subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "        for _ in range(3 * len(os.sched_getaffinity(0)))]"
    ).ok()
    try:
        yield
    finally:
        kernel.execute("for hog in hogs:\n    hog.kill()\n    hog.wait()\ndel hogs").ok()


@pytest.mark.timing  # its rank must get 5% of a core beside the hogs: not beside parallel tests too
def test_a_rank_computing_between_collectives_is_no_hang_even_on_a_busy_machine(kernel, busy_machine):
    result = kernel.execute(
        """#pragma taas --gpus 4 --hang-after 2 --timeout 30
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    end, n = time.monotonic() + 5, 0  # 2.5 times --hang-after, printing nothing
    while time.monotonic() < end:
        n += 1
dist.all_reduce(torch.ones(1))
""",
        timeout=60,
    ).ok()
    no_diagnosis(result)


# -- 8. a long sleep before a barrier ---------------------------------------------------------------------------
def test_a_rank_sleeping_before_a_barrier_is_named_at_its_sleep(kernel):
    result = kernel.execute(
        """#pragma taas --gpus 4 --hang-after 2 --timeout 10
import time, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    time.sleep(30)
dist.barrier()
""",
        timeout=40,
    )
    hang = diagnosis(result)
    assert re.fullmatch(
        r"rank 0 has not entered barrier #1 that ranks 1-3 wait in; it is at Cell In\[\d+\], line 5 "
        r"\(time\.sleep\(30\)\)",
        hang.cause,
    ), hang.cause
    assert [(sorted(p.ranks), p.doing, p.at) for p in hang.places] == [
        ([0], "in no collective", (5, "<module>", "time.sleep(30)")),
        ([1, 2, 3], "in barrier #1 for N s", (6, "<module>", "dist.barrier()")),
    ]
    assert_usable(kernel)


# -- 9, 10. an interrupt, a failure: where the others were --------------------------------------------------
def test_an_interrupt_of_hung_ranks_shows_each_place_once(kernel):
    result = kernel.execute(
        """#pragma taas --gpus 3
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 2:
    time.sleep(60)
dist.all_reduce(torch.ones(1))
""",
        interrupt_after=3,
        timeout=40,
    )
    assert result.error["ename"] == "RunInterrupted"
    found = where(result, "where the ranks were when interrupted:")
    assert [(sorted(p.ranks), p.doing, p.at) for p in found] == [
        ([0, 1], "in all_reduce #1 (4 B float32) for N s", (6, "<module>", "dist.all_reduce(torch.ones(1))")),
        ([2], "in no collective", (5, "<module>", "time.sleep(60)")),
    ]
    assert result.traceback.count("dist.all_reduce(torch.ones(1))") == 1, "one stack for both ranks"
    assert_usable(kernel)


LOCK_STEP = """#pragma taas --gpus 2
import time, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
print("training", flush=True)
while True:
    loss = model(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    loss.item()
    time.sleep(0.01)  # about 60 steps a second, as a real step's compute would pace it
"""
AT = re.compile(r"finished #(?P<finished>\d+), in no collective|in \w+ #(?P<inside>\d+)")


def positions(found: list[Place]) -> dict[int, float]:
    """Each rank's place in the sequence of collectives: N when in collective #N, N + 0.5 once it finished #N and
    entered no other. A place's header says it for all its ranks, or rank by rank ("rank 0 in all_reduce #9;
    rank 1 finished #8, in no collective")."""
    at: dict[int, float] = {}
    for place in found:
        parts = re.findall(r"(?:^|; )(ranks? [\d,-]+) (.+?)(?=; ranks? |$)", place.doing) or [
            (f"ranks {','.join(map(str, sorted(place.ranks)))}", place.doing)
        ]
        for who, doing in parts:
            match = AT.search(doing)
            assert match, f"no position in {doing!r}"
            value = int(match["inside"]) if match["inside"] else int(match["finished"]) + 0.5
            at.update(dict.fromkeys(ranks_in(who.split(" ", 1)[1]), value))
    return at


@pytest.mark.timeout(300)  # six runs started, trained and interrupted: 4-18 s each beside the other tiers' work
def test_an_interrupted_lock_step_loop_shows_its_ranks_at_one_moment(kernel):
    """DDP keeps two ranks within one collective of each other; interrupted at random moments, each time, the
    diagnosis reads each rank at the moment its stacks were taken (samples up to a second old read them dozens of
    collectives apart on a busy machine), and every rank is named with its stack. Each rank answers from its own
    thread, within a scheduling delay of the other's: on a machine as busy as the test tiers make it, tens of
    milliseconds, a few steps of a fast loop; this one takes about 60 steps a second (5.5 steps apart, 90 ms, seen
    once in the kernel tier; 13 steps, about 220 ms, once in CI beside the other five workers: 20 still tells one
    moment from a sample a second old, 60 steps)."""
    rng = random.Random(7)
    for _ in range(6):
        result = kernel.execute(LOCK_STEP, interrupt_after=rng.uniform(0.2, 1.2), timeout=40, counted_from="training")
        assert result.error is not None and result.error["ename"] == "RunInterrupted", result.traceback
        found = where(result, "where the ranks were when interrupted:")
        assert all(place.stack for place in found), found
        at = positions(found)
        assert set(at) == {0, 1} and abs(at[0] - at[1]) <= 20, f"{at}\n{result.traceback}"
    assert_usable(kernel)


FAILING_WHILE_OTHERS_WAIT = """#pragma taas --gpus 4 --hang-after 10 --timeout 20
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep({delay})
    raise ValueError("bad batch")
dist.all_reduce(torch.ones(1))
"""


@pytest.fixture(scope="module")
def failed_after_2s(kernel):
    """Rank 1 fails 2 s into the cell, while ranks 0, 2 and 3 wait for it in all_reduce #1."""
    result = kernel.execute(FAILING_WHILE_OTHERS_WAIT.format(delay=2), timeout=40)
    assert result.error["evalue"] == "rank 1 failed: ValueError: bad batch"
    return result


def test_a_failure_shows_where_the_others_waited_for_it(failed_after_2s, kernel):
    found = where(failed_after_2s, "where they were when rank 1 failed:")
    # Whether a peer's collective broke as rank 1 exited (gloo tells its neighbours at once) or taas stopped it
    # still waiting, it is shown at the line it waited at: its broken collective's frames come with its error.
    assert [(sorted(p.ranks), p.at) for p in found] == [([0, 2, 3], (7, "<module>", "dist.all_reduce(torch.ones(1))"))]
    # The collective's number, tensors and time come from the rank's samples, about one a second: on a busy machine a
    # rank whose collective broke at once may have sent none yet ("rank 0 in all_reduce; ranks 2-3 in all_reduce #1
    # (4 B float32) for N s", seen once in the kernel tier).
    [place] = found
    said = place.doing.split("; ")
    assert "in all_reduce #1 (4 B float32) for N s" in {re.sub(r"^ranks? [\d,-]+ ", "", part) for part in said}, said
    assert all(re.fullmatch(r"(ranks? [\d,-]+ )?in all_reduce( #1 \(4 B float32\) for N s)?", part) for part in said)
    assert "taas_magic" not in failed_after_2s.traceback and "ultratb" not in failed_after_2s.traceback
    assert_usable(kernel)


def test_a_failure_at_once_still_shows_the_collective_a_rank_waited_in(kernel):
    result = kernel.execute(FAILING_WHILE_OTHERS_WAIT.format(delay=0), timeout=40)
    assert result.error["evalue"] == "rank 1 failed: ValueError: bad batch"
    found = where(result, "where they were when rank 1 failed:")
    # No rank has sampled its activity yet: the stack says which collective a rank is in, and the position read
    # with it, for a rank still waiting when taas asked, its number and tensors.
    waiting = [p for p in found if p.at == (7, "<module>", "dist.all_reduce(torch.ones(1))")]
    # Whether a rank's place came with its number and how long it waited depends on when it was asked.
    noted = r"^ranks? [\d,-]+ | #1 \(4 B float32\)| for N s"
    said = {re.sub(noted, "", part) for p in waiting for part in p.doing.split("; ")}
    assert waiting and said == {"in all_reduce"}, found


# -- 11. turning it off, and its default --------------------------------------------------------------------------
SLEEPERS = "#pragma taas --gpus 2 --timeout 4{options}\nimport time\ntime.sleep(30)\n"


def test_the_default_comes_from_config_and_a_cells_option_wins_with_0_turning_it_off(kernel):
    assert "default --hang-after: 120 s\n" in kernel.execute("%taas").ok().stdout
    kernel.execute("%config TaasMagics.hang_after = 2").ok()
    try:
        assert "default --hang-after: 2 s (from %config TaasMagics.hang_after)" in kernel.execute("%taas").ok().stdout
        by_default = kernel.execute(SLEEPERS.format(options=""), timeout=40)
        hang = diagnosis(by_default)
        assert re.fullmatch(
            r"no rank is in a collective: ranks 0-1 are at Cell In\[\d+\], line 3 \(time\.sleep\(30\)\); "
            r"they wait in the code itself, on a sleep, a lock or a queue",
            hang.cause,
        ), hang.cause
        assert hang.footer == FOOTER.format(2), "the footer names the setting that spoke"
        assert [(sorted(p.ranks), p.at) for p in hang.places] == [([0, 1], (3, "<module>", "time.sleep(30)"))]
        off = kernel.execute(SLEEPERS.format(options=" --hang-after 0"), timeout=40)
        assert off.error["ename"] == "RunTimedOut"
        no_diagnosis(off)
    finally:
        kernel.execute("%config TaasMagics.hang_after = 120").ok()


@pytest.mark.parametrize("value", ["-1", "abc"])
@pytest.mark.timing
def test_a_bad_hang_after_is_a_one_line_usage_error_before_anything_starts(kernel, value):
    result = kernel.execute(f"#pragma taas --gpus 2 --hang-after {value}\nprint('ran')", timeout=30)
    assert result.error["ename"] == "TaasUsageError"
    assert result.error["evalue"] == (
        f"argument --hang-after: {value!r} is not allowed: use a number of seconds greater than 0, or 0 to turn it off"
    )
    assert "ran" not in result.stdout and result.seconds < 2
    assert kernel.children() == []


# -- 12. in a session ---------------------------------------------------------------------------------------------
def test_the_watchdog_speaks_in_a_session_cell_and_the_session_goes_on(kernel):
    first = kernel.execute(
        "#pragma taas --gpus 2 --keep\nimport os, time, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\nprint('pid ' + str(os.getpid()), flush=True)",
        timeout=60,
    ).ok()
    try:
        result = kernel.execute("#pragma taas --hang-after 2 --timeout 4\ntime.sleep(30)\n", timeout=40)
        hang = diagnosis(result)
        assert hang.cause.startswith("no rank is in a collective: ranks 0-1 are at Cell In[")
        assert [(sorted(p.ranks), p.at) for p in hang.places] == [([0, 1], (2, "<module>", "time.sleep(30)"))]
        assert result.error["ename"] == "RunTimedOut"
        assert "now interrupted; the session goes on" in result.error["evalue"]
        again = kernel.execute(
            "#pragma taas\ndist.barrier()\nprint('pid ' + str(os.getpid()), flush=True)", timeout=30
        ).ok()
        assert sorted(re.findall(r"pid (\d+)", again.each_rank())) == sorted(
            re.findall(r"pid (\d+)", first.each_rank())
        )
    finally:
        kernel.execute("%taas stop").ok()
