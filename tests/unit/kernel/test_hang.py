"""The hang doctor: where a run's processes are and why they do not move, from what they reported.

Stacks are faulthandler dumps as a rank writes them (the cell's thread as the current one, taas's
own threads beside it, frames down to where taas started the rank's work), with real paths: the
standard library's and the installed packages' of this interpreter. Samples are ``RankActivity``
records as the rank's sampler makes them from torch's flight recorder.
"""

from __future__ import annotations

import linecache
import re
import sysconfig

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.kernel import ranks_in

from taas_magic.kernel.diagnosis.hang import Process, cause, describe, doing, where_lines
from taas_magic.kernel.diagnosis.stacks import parse_stacks
from taas_magic.per_rank import span
from taas_magic.process import child
from taas_magic.rank import cell, vitals, worker
from taas_magic.wire.events import Key, Producer
from taas_magic.wire.records import Collective, RankActivity

LIBRARIES = sysconfig.get_paths()["purelib"]
STDLIB = sysconfig.get_paths()["stdlib"]
C10D = f"{LIBRARIES}/torch/distributed/distributed_c10d.py"
LOGGER = f"{LIBRARIES}/torch/distributed/c10d_logger.py"
CELL = "/tmp/ipykernel_1/123.py"
CELL_NAMES = {CELL: "Cell In[7]"}
SOURCE = {
    3: "dist.init_process_group('gloo')",
    12: "time.sleep(600)",
    14: "dist.all_reduce(grads)",
    16: "batch = next(batches)",
}

Frame = tuple[str, int, str]
ALL_REDUCE: list[Frame] = [(C10D, 2501, "all_reduce"), (LOGGER, 83, "wrapper"), (CELL, 14, "<module>")]
BROADCAST: list[Frame] = [(C10D, 2201, "broadcast"), (LOGGER, 83, "wrapper"), (CELL, 14, "<module>")]
SLEEP: list[Frame] = [(CELL, 12, "<module>")]
NEXT_BATCH: list[Frame] = [
    (f"{STDLIB}/threading.py", 320, "wait"),
    (f"{STDLIB}/queue.py", 171, "get"),
    (CELL, 16, "<module>"),
]
SETUP: list[Frame] = [
    (f"{LIBRARIES}/torch/distributed/rendezvous.py", 250, "_env_rendezvous_handler"),
    (C10D, 1500, "init_process_group"),
    (LOGGER, 83, "wrapper"),
    (CELL, 3, "<module>"),
]
STORE = "10.0.0.1:29400"


@pytest.fixture(autouse=True)
def cell_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cell's source, where the kernel has it: in linecache (IPython puts every cell there)."""
    lines = [SOURCE.get(number, "") + "\n" for number in range(1, 30)]
    monkeypatch.setitem(linecache.cache, CELL, (0, None, lines, CELL))


def thread(header: str, frames: list[Frame]) -> str:
    return f"{header} (most recent call first):\n" + "".join(
        f'  File "{file}", line {line} in {function}\n' for file, line, function in frames
    )


def taas_thread(ident: int = 3) -> str:
    return thread(
        f"Thread 0x00007f000000000{ident}",
        [
            (child.__file__, 128, "watch"),
            (f"{STDLIB}/threading.py", 982, "run"),
            (f"{STDLIB}/threading.py", 1045, "_bootstrap_inner"),
            (f"{STDLIB}/threading.py", 1002, "_bootstrap"),
        ],
    )


def dump(frames: list[Frame], *others: str) -> str:
    """A rank's dump: taas's lifeline thread, ``others``, and the cell's thread down to taas's frames."""
    main = thread(
        "Current thread 0x00007f0000000001",
        frames + [(cell.__file__, 40, "run_cell"), (worker.__file__, 60, "run_rank"), (worker.__file__, 20, "main")],
    )
    return "\n".join([taas_thread(), *others, main])


def collective(
    seq: int = 5, op: str = "all_reduce", shape: tuple[int, ...] = (1000,), group: str = "0", seconds: float = 118.0
) -> Collective:
    return Collective(group, seq, op, [list(shape)], ["Float"], seconds)


def activity(*collectives: Collective, finished: dict[str, int] | None = None, **fields) -> RankActivity:
    return RankActivity(100.0, 5.0, {"0": 4} if finished is None else finished, list(collectives), **fields)


def rank(
    key: int,
    sample: RankActivity | None = None,
    stack: str = "",
    ended: str = "",
    age: float = 0.0,
    node: int | None = None,
) -> Process:
    return Process(key, f"rank {key}", sample, age, stack, ended, node)


def waiting_in_all_reduce(*keys: int) -> list[Process]:
    return [rank(key, activity(collective()), dump(ALL_REDUCE)) for key in keys]


# -- the likely cause -----------------------------------------------------------------------------
def test_ranks_in_one_collective_are_one_group_though_one_sample_came_before_its_tensors_were_read():
    fresh = Collective("0", 5, "", [], [], 0.0)
    processes = [
        rank(0, activity(collective(seconds=10.0)), dump(ALL_REDUCE)),
        rank(1, activity(fresh), dump(ALL_REDUCE)),
    ]
    assert where_lines(processes, CELL_NAMES)[0] == "ranks 0-1: in all_reduce #5 (4 KB float32) for 10 s:"
    assert cause(processes + [rank(2, activity(), dump(SLEEP))], CELL_NAMES).startswith(
        "rank 2 has not entered all_reduce #5 that ranks 0-1 wait in; "
    )


def test_a_collective_entered_just_now_is_named_by_its_number_and_never_taken_for_another():
    fresh = Collective("0", 5, "", [], [], 0.0)  # read from the group's counters alone: no operation, no tensors
    processes = waiting_in_all_reduce(0, 1) + [
        rank(2, activity(fresh), dump(ALL_REDUCE)),
        rank(3, activity(), dump(SLEEP)),
    ]
    assert cause(processes, CELL_NAMES).startswith("rank 3 has not entered all_reduce #5 that ranks 0-2 wait in; ")
    assert cause([rank(0, activity(fresh)), rank(1, activity())], CELL_NAMES).startswith(
        "rank 1 has not entered collective #5 that rank 0 waits in"
    )
    assert doing(rank(0, activity(fresh))) == "in a collective #5"


@pytest.mark.parametrize(
    "missing, why",
    [
        (rank(3, activity(), dump(SLEEP)), "it is at Cell In[7], line 12 (time.sleep(600))"),
        (rank(3, ended="had finished the cell"), "it had finished the cell"),
        (
            rank(3, activity(waiting="train_loader", waited=30.0), dump(NEXT_BATCH)),
            "it waits for data from train_loader",
        ),
        (
            rank(3, activity(collective(3, group="1"), finished={"0": 4, "1": 2}), dump(ALL_REDUCE)),
            "it is in all_reduce #3 of group 1 (4 KB float32)",
        ),
    ],
)
def test_a_rank_that_has_not_entered_the_collective_the_others_wait_in_is_named_with_what_it_does(missing, why):
    assert (
        cause([*waiting_in_all_reduce(0, 1, 2), missing], CELL_NAMES)
        == f"rank 3 has not entered all_reduce #5 that ranks 0-2 wait in; {why}"
    )


def test_several_ranks_missing_at_the_same_line_are_said_once():
    processes = waiting_in_all_reduce(0, 1, 5) + [rank(key, activity(), dump(SLEEP)) for key in (2, 3, 4)]
    assert cause(processes, CELL_NAMES) == (
        "ranks 2-4 have not entered all_reduce #5 that ranks 0-1,5 wait in; "
        "they are at Cell In[7], line 12 (time.sleep(600))"
    )


def test_missing_ranks_at_different_places_are_each_named():
    processes = waiting_in_all_reduce(0, 1) + [rank(2, activity(), dump(SLEEP)), rank(3, ended="had finished the cell")]
    assert cause(processes, CELL_NAMES) == (
        "ranks 2-3 have not entered all_reduce #5 that ranks 0-1 wait in; "
        "rank 2 is at Cell In[7], line 12 (time.sleep(600)); "
        "rank 3 had finished the cell"
    )


def test_different_collectives_at_the_same_number_are_named():
    processes = waiting_in_all_reduce(0, 1) + [
        rank(key, activity(collective(op="broadcast")), dump(BROADCAST)) for key in (2, 3)
    ]
    assert (
        cause(processes, CELL_NAMES)
        == "the ranks called different collectives: ranks 0-1 are in all_reduce #5 and ranks 2-3 are in broadcast #5"
    )


def test_the_same_collective_with_different_tensors_is_named_with_their_shapes():
    processes = waiting_in_all_reduce(0, 1, 2) + [rank(3, activity(collective(shape=(999,))), dump(ALL_REDUCE))]
    assert (
        cause(processes, CELL_NAMES) == "the ranks called all_reduce #5 with different tensors: "
        "ranks 0-2 with [1000] float32; rank 3 with [999] float32"
    )


def test_every_rank_in_the_same_collective_blames_the_backend():
    assert cause(waiting_in_all_reduce(0, 1, 2, 3), CELL_NAMES) == (
        "every rank is in all_reduce #5 (4 KB float32): the backend itself does not complete it (a network or "
        "driver problem; NCCL_DEBUG=INFO or TORCH_CPP_LOG_LEVEL=INFO say more)"
    )


def test_every_rank_waiting_for_data_blames_the_producers():
    processes = [rank(key, activity(waiting="train_loader", waited=30.0 + key), dump(NEXT_BATCH)) for key in range(4)]
    assert (
        cause(processes, CELL_NAMES)
        == "every rank waits for data from train_loader: its producers sent nothing for 30 s"
    )


def test_setup_waiting_for_a_rank_that_exited_names_the_store_and_the_rank():
    joined = [rank(key, activity(finished={}, setup=40.0, store=STORE), dump(SETUP)) for key in range(3)]
    processes = joined + [rank(3, ended="exited early with sys.exit(0)")]
    assert cause(processes, CELL_NAMES) == (
        "ranks 0-2 wait in process-group setup at the store 10.0.0.1:29400 for "
        "rank 3, which has not joined: it exited early with sys.exit(0)"
    )


def test_setup_is_recognized_from_the_stack_alone():
    """A sample taken before the sampler saw init_process_group: the main thread's frames say it."""
    processes = [rank(0, None, dump(SETUP)), rank(1, activity(finished={}), dump(SLEEP))]
    assert cause(processes, CELL_NAMES) == (
        "rank 0 waits in process-group setup for rank 1, which has not joined: "
        "it is at Cell In[7], line 12 (time.sleep(600))"
    )


def test_setup_that_every_rank_joined_blames_the_network():
    processes = [rank(key, activity(finished={}, setup=40.0, store=STORE), dump(SETUP)) for key in range(4)]
    assert cause(processes, CELL_NAMES) == (
        "every rank waits in process-group setup at the store 10.0.0.1:29400 and all of them joined it: the backend "
        "cannot connect its ranks (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME choose the network)"
    )


def test_ranks_in_no_collective_are_waiting_in_the_code_itself():
    processes = [rank(key, activity(), dump(SLEEP)) for key in range(4)]
    assert cause(processes, CELL_NAMES) == (
        "no rank is in a collective: ranks 0-3 are at Cell In[7], line 12 "
        "(time.sleep(600)); they wait in the code itself, on a sleep, a lock or a queue"
    )


def test_a_rank_that_sent_no_stack_says_so():
    assert (
        cause(waiting_in_all_reduce(0) + [rank(1, activity())], CELL_NAMES)
        == "rank 1 has not entered all_reduce #5 that rank 0 waits in; it sent no stack"
    )


def test_several_killed_ranks_are_said_in_the_plural():
    processes = waiting_in_all_reduce(0, 1) + [rank(key, ended="was killed by SIGKILL") for key in (2, 3)]
    assert cause(processes, CELL_NAMES).endswith("; they were killed by SIGKILL")


# -- what each process is doing ---------------------------------------------------------------------
def test_a_sampled_duration_is_brought_up_to_now():
    assert doing(rank(0, activity(collective(seconds=118.0)), age=2.0)) == "in all_reduce #5 (4 KB float32) for 120 s"
    assert (
        doing(rank(0, activity(waiting="val_loader", waited=3.0), age=1.0))
        == "waiting for data from val_loader for 4 s"
    )
    assert doing(rank(0, activity(finished={}, setup=5.0))) == "in process-group setup for 5 s"
    assert doing(rank(0, activity(finished={"0": 4, "1": 2}))) == "finished #4, #2 of group 1, in no collective"
    assert doing(rank(0, ended="exited with code 1")) == "exited with code 1"


def test_a_collective_is_described_by_its_size_and_type():
    assert (
        describe(Collective("0", 1235, "all_reduce", [[1000, 1000]], ["Float"], 1.0))
        == "all_reduce #1235 (4 MB float32)"
    )
    assert (
        describe(Collective("1", 3, "send", [[256], [256]], ["BFloat16", "Long"], 1.0, p2p=True))
        == "send #3 (p2p) of group 1 (2.56 KB bfloat16/int64)"
    )
    assert describe(Collective("0", 7, "barrier", [], [], 1.0)) == "barrier #7"


# -- grouped stacks --------------------------------------------------------------------------------
def test_identical_stacks_are_grouped_and_different_ones_shown_apart():
    processes = waiting_in_all_reduce(0, 1, 2, 4, 5, 6, 7) + [rank(3, activity(), dump(SLEEP))]
    assert where_lines(processes, CELL_NAMES) == [
        "ranks 0-2,4-7: in all_reduce #5 (4 KB float32) for 118 s:",
        "    in all_reduce (torch/distributed/distributed_c10d.py, line 2501), called from:",
        "    Cell In[7], line 14 in <module>",
        "      dist.all_reduce(grads)",
        "rank 3: finished #4, in no collective:",
        "    Cell In[7], line 12 in <module>",
        "      time.sleep(600)",
    ]


def test_on_a_cluster_each_group_names_its_nodes():
    processes = waiting_in_all_reduce(0, 1, 2, 4, 5, 6, 7) + [rank(3, activity(), dump(SLEEP))]
    headers = [line for line in where_lines(processes, CELL_NAMES, ranks_per_node=4) if not line.startswith(" ")]
    assert headers == [
        "ranks 0-2,4-7 (nodes 0, 1): in all_reduce #5 (4 KB float32) for 118 s:",
        "rank 3 (node 0): finished #4, in no collective:",
    ]
    placed = [rank(0, activity(), dump(SLEEP), node=5)]  # the node a cluster placed it on, not rank // ranks_per_node
    assert where_lines(placed, CELL_NAMES, ranks_per_node=4)[0] == "rank 0 (node 5): finished #4, in no collective:"


def test_ranks_in_the_same_place_for_different_times_are_one_group_with_the_longest():
    processes = [
        rank(0, activity(collective(seconds=10.0)), dump(ALL_REDUCE)),
        rank(1, activity(collective(seconds=20.0)), dump(ALL_REDUCE)),
    ]
    assert where_lines(processes, CELL_NAMES)[:2] == [
        "ranks 0-1: in all_reduce #5 (4 KB float32) for 20 s:",
        "    in all_reduce (torch/distributed/distributed_c10d.py, line 2501), called from:",
    ]


def test_the_same_place_doing_different_things_shows_its_stack_once():
    processes = [
        rank(0, activity(collective(seconds=10.0)), dump(ALL_REDUCE)),
        rank(1, activity(waiting="train_loader", waited=3.0), dump(ALL_REDUCE)),
    ]
    assert where_lines(processes, CELL_NAMES)[:2] == [
        "ranks 0-1: rank 0 in all_reduce #5 (4 KB float32) for 10 s; rank 1 waiting for data from train_loader "
        "for 3 s:",
        "    in all_reduce (torch/distributed/distributed_c10d.py, line 2501), called from:",
    ]


def test_taas_threads_are_dropped_and_the_users_kept():
    loader = thread(
        "Thread 0x00007f0000000004",
        [
            ("/home/me/project/prefetch.py", 31, "fill"),
            (f"{STDLIB}/threading.py", 982, "run"),
            (f"{STDLIB}/threading.py", 1045, "_bootstrap_inner"),
            (f"{STDLIB}/threading.py", 1002, "_bootstrap"),
        ],
    )
    sampler = thread(
        "Thread 0x00007f0000000005", [(vitals.__file__, 60, "_every_interval"), (f"{STDLIB}/threading.py", 982, "run")]
    )
    pin_memory = thread(
        "Thread 0x00007f0000000006",
        [
            (f"{LIBRARIES}/torch/utils/data/_utils/pin_memory.py", 54, "_pin_memory_loop"),
            (f"{STDLIB}/threading.py", 982, "run"),
        ],
    )
    stack = dump(SLEEP, loader, sampler, pin_memory)
    assert [thread.main for thread in parse_stacks(stack)] == [True, False]
    assert where_lines([rank(0, activity(), stack)], CELL_NAMES) == [
        "rank 0: finished #4, in no collective:",
        "    Cell In[7], line 12 in <module>",
        "      time.sleep(600)",
        "    another thread:",
        '    File "/home/me/project/prefetch.py", line 31 in fill',
    ], "a thread's own start left out"


def test_the_users_own_files_show_their_source_and_libraries_do_not(monkeypatch: pytest.MonkeyPatch):
    train = "/home/me/project/train.py"
    lines = ["def step(model, batch):\n", "    loss = model(batch).sum()\n", "    loss.backward()\n"]
    monkeypatch.setitem(linecache.cache, train, (0, None, lines, train))
    stack = dump(
        [(f"{LIBRARIES}/torch/autograd/__init__.py", 251, "backward"), (train, 3, "step"), (CELL, 14, "<module>")]
    )
    assert where_lines([rank(0, activity(), stack)], CELL_NAMES)[1:] == [
        "    in backward (torch/autograd/__init__.py, line 251), called from:",
        '    File "/home/me/project/train.py", line 3 in step',
        "      loss.backward()",
        "    Cell In[7], line 14 in <module>",
        "      dist.all_reduce(grads)",
    ]


def test_ranks_that_left_are_listed_without_a_stack_and_producers_by_name():
    producer = Process(
        Producer(0, 1), "producer 1 of train_loader", None, 0.0, dump([("/home/me/project/data.py", 9, "__getitem__")])
    )
    processes = [rank(1, ended="had finished the cell"), rank(0, activity(), dump(SLEEP)), producer]
    assert where_lines(processes, CELL_NAMES) == [
        "rank 0: finished #4, in no collective:",
        "    Cell In[7], line 12 in <module>",
        "      time.sleep(600)",
        "rank 1: had finished the cell",
        "producer 1 of train_loader:",
        '    File "/home/me/project/data.py", line 9 in __getitem__',
    ]


def test_a_process_that_sent_no_stack_says_so():
    assert where_lines([rank(0, activity(), dump(SLEEP)), rank(1, activity())], CELL_NAMES)[-2:] == [
        "rank 1: finished #4, in no collective",
        "    (no stack received)",
    ]


def test_a_process_that_sent_no_stack_says_so_beside_one_that_had_left():
    lines = where_lines(
        [rank(0, activity(), dump(SLEEP)), rank(1, ended="had finished the cell"), rank(2, activity())], CELL_NAMES
    )
    after = {line: lines[index + 1 : index + 2] for index, line in enumerate(lines)}
    assert after["rank 2: finished #4, in no collective"] == ["    (no stack received)"]
    assert after["rank 1: had finished the cell"] != ["    (no stack received)"]


# -- properties ---------------------------------------------------------------------------------------
def parse_span(text: str) -> set[int]:
    """The ranks ``span`` wrote: "rank 3", "ranks 0-2,4-7"."""
    match = re.fullmatch(r"ranks? ([0-9,-]*)", text)
    assert match, text
    return ranks_in(match[1])


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(0, 2000), min_size=1))
def test_span_says_every_rank_once(ranks: set[int]):
    text = span(ranks)
    assert parse_span(text) == ranks
    assert text.startswith("rank " if len(ranks) == 1 else "ranks ")


COMMON = [
    collective(),
    collective(op="broadcast"),
    collective(shape=(999,)),
    collective(6),
    collective(3, group="1"),
    Collective("0", 2, "send", [[8]], ["Long"], 3.0, p2p=True),
]  # often the same: ranks meet, or disagree
COLLECTIVES = st.sampled_from(COMMON) | st.builds(
    Collective,
    group=st.sampled_from(["0", "0", "1", ""]),
    seq=st.integers(4, 6),
    op=st.sampled_from(["all_reduce", "broadcast", "barrier", "send", "recv"]),
    shapes=st.lists(st.lists(st.integers(0, 5000), max_size=3), max_size=3),
    dtypes=st.lists(st.sampled_from(["Float", "Long", "BFloat16", "Float8_e4m3fn", "UInt16"]), max_size=3),
    seconds=st.floats(0, 1e6),
    p2p=st.booleans(),
)
SECONDS = st.floats(0, 1e6)
ACTIVITIES = st.none() | st.builds(
    RankActivity,
    at=SECONDS,
    cpu=SECONDS,
    finished=st.dictionaries(st.sampled_from(["0", "1"]), st.integers(0, 6)),
    collectives=st.lists(COLLECTIVES, max_size=2),
    waiting=st.sampled_from(["", "train_loader", "val_loader"]),
    waited=SECONDS,
    taken=st.integers(0, 100),
    setup=st.none() | st.none() | SECONDS,
    store=st.sampled_from(["", STORE]),
)
STACKS = (
    st.sampled_from(
        [
            "",
            dump(ALL_REDUCE),
            dump(BROADCAST),
            dump(SLEEP),
            dump(NEXT_BATCH),
            dump(SETUP),
            dump([]),
            taas_thread(),
            "Current thread 0x1 (most recent call first):\n",
        ]
    )
    | st.text()
)
ENDED = st.sampled_from(
    [""] * 6
    + [
        "had finished the cell",
        "exited early with sys.exit(0)",
        "exited with code 1",
        "was killed by SIGKILL",
        "failed (ValueError)",
        "is still running",
        "had left",
    ]
)


@st.composite
def runs(draw: st.DrawFn) -> list[Process]:
    """Ranks (and some producers) in any combination of collectives, waits, setup, stacks and exits; in
    a crowded run every rank sits in one of a few collectives, where they meet or disagree."""
    keys: list[Key] = list(range(draw(st.integers(0, 9))))
    keys += [Producer(0, index) for index in range(draw(st.integers(0, 2)))]
    crowded = draw(st.booleans())
    processes = []
    for key in keys:
        sample = (
            activity(*draw(st.lists(st.sampled_from(COMMON), min_size=1, max_size=2))) if crowded else draw(ACTIVITIES)
        )
        label = f"rank {key}" if isinstance(key, int) else f"producer {key.index} of train_loader"
        processes.append(
            Process(
                key,
                label,
                sample,
                draw(st.floats(0, 1e4)),
                draw(STACKS),
                draw(ENDED),
                draw(st.none() | st.integers(0, 3)),
            )
        )
    return processes


@settings(max_examples=200, deadline=None)
@given(runs())
def test_the_cause_is_always_one_line(processes: list[Process]):
    said = cause(processes, CELL_NAMES)
    assert said and len(said.splitlines()) == 1
    assert all(len(doing(process).splitlines()) <= 1 for process in processes)


@settings(max_examples=150, deadline=None)
@given(runs(), st.sampled_from([0, 2, 8]))
def test_where_names_every_process_once_whatever_the_grouping(processes: list[Process], ranks_per_node: int):
    named: list[Key] = []
    for header in where_lines(processes, CELL_NAMES, ranks_per_node):
        if header.startswith(" "):
            continue
        who = header.split(": ", 1)[0]
        for part in who.split("; "):
            if part.startswith("producer "):
                named.append(Producer(0, int(part.split()[1])))
            else:
                named += sorted(parse_span(re.sub(r" \(nodes? [0-9, ]+\)$", "", part)))
    assert sorted(named, key=str) == sorted((p.key for p in processes), key=str)
