"""Every rank's values in the notebook: `--return NAMES --from RANKS`, and a session's `%taas pull` / `%taas push`."""

from __future__ import annotations

import pytest

BRANCHES = """import taas, torch
x = torch.tensor(float(taas.rank()))
same = "alike"
if taas.rank() == 1:
    only_in_1 = 1
"""


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_from_all_brings_each_ranks_value_as_a_per_rank(kernel, start):
    kernel.execute("globals().pop('only_in_1', None)").ok()  # forked ranks would have the notebook's
    result = kernel.execute(f"#pragma taas --gpus 3 --start {start} --from all\n" + BRANCHES).ok()
    assert result.stderr == "", "a name bound in some ranks only comes back from those, without a word"
    assert kernel.value("(type(x).__name__, x.ranks, [float(v) for v in x])") == ("PerRank", (0, 1, 2), [0.0, 1.0, 2.0])
    assert kernel.value("(float(x[2]), len(x), list(same))") == (2.0, 3, ["alike"] * 3)
    assert kernel.value("(only_in_1.ranks, only_in_1[1])") == ((1,), 1)
    assert kernel.value("repr(same)") == "ranks 0-2: 'alike'", "identical values show once"
    assert kernel.value("repr(x)") == "rank 0: tensor(0.)\nrank 1: tensor(1.)\nrank 2: tensor(2.)"
    shown = kernel.execute("same").ok().displays
    assert shown and shown[0]["text/plain"] == "ranks 0-2: 'alike'", "IPython shows it as repr does"


def test_from_one_rank_brings_that_ranks_value_as_it_is(kernel):
    kernel.execute("globals().pop('only_in_1', None)").ok()  # forked ranks would have the notebook's
    kernel.execute("#pragma taas --gpus 3 --return x --from 2\n" + BRANCHES).ok()
    assert kernel.value("(type(x).__name__, float(x))") == ("Tensor", 2.0)
    result = kernel.execute("#pragma taas --gpus 3 --return x,only_in_1 --from 0-1\n" + BRANCHES).ok()
    assert result.stderr == "taas: not copied back from rank 0: only_in_1 (not bound when the cell ended)\n"
    assert kernel.value("(x.ranks, only_in_1.ranks)") == ((0, 1), (1,))


def test_a_value_that_cannot_come_back_from_one_rank_still_comes_from_the_others(kernel):
    result = kernel.execute("""#pragma taas --gpus 2 --return lock,n --from all
import threading, taas
lock = threading.Lock() if taas.rank() == 1 else "free"
n = taas.rank()
""").ok()
    assert result.stderr.startswith("taas: not copied back from rank 1: lock (lock cannot be pickled")
    assert result.stderr.count("\n") == 1
    assert kernel.value("(lock.ranks, lock[0], list(n))") == ((0,), "free", [0, 1])


@pytest.mark.parametrize(
    "line, message",
    [
        ("--gpus 2 --from 2", "--from 2: the run has ranks 0-1, not rank 2"),
        (
            "--gpus 2 --from 99999999999999999999",
            "--from 99999999999999999999: the run has ranks 0-1, not rank 99999999999999999999",
        ),
        ("--gpus 2 --from 0,1-3", "--from 0,1-3: the run has ranks 0-1, not rank 2"),
        ("--gpus 2 --from 1,x", "'1,x' is not a list of ranks"),
        ("--gpus 2 --from 1,1", "'1,1' names a rank twice"),
        ("--gpus 2 --from 3-1", "'3-1' is not a list of ranks"),
    ],
)
def test_bad_from_is_one_line_before_anything_starts(kernel, line, message):
    result = kernel.execute(f"%%taas {line}\nprint('ran')")
    assert message in result.traceback or message in result.stderr
    assert "ran" not in result.stdout


def test_pull_and_push_move_names_between_the_notebook_and_a_sessions_ranks(fresh_kernel):
    kernel = fresh_kernel
    kernel.execute("#pragma taas --gpus 3 --keep --return none\n" + BRANCHES + "step = taas.rank() * 10").ok()
    assert kernel.value("'x' in globals()") is False
    kernel.execute("%taas pull x step").ok()
    assert kernel.value("([float(v) for v in x], list(step))") == ([0.0, 1.0, 2.0], [0, 10, 20])
    kernel.execute("%taas pull step --ranks 2").ok()
    assert kernel.value("step") == 20, "from one rank a value comes as it is"
    result = kernel.execute("%taas pull only_in_1,missing --ranks 0-1").ok()
    assert result.stderr == (
        "taas: not copied back from rank 0: only_in_1 (the rank has no such name); "
        "from ranks 0-1: missing (the rank has no such name)\n"
    ), "a pull has no cell that ended"
    pushed = kernel.execute("numbers = (n for n in range(3))\n%taas push numbers")
    assert pushed.error["evalue"].startswith(
        "%taas push numbers: 'numbers' (a builtins.generator) cannot be sent to a session's ranks ("
    ) and pushed.error["evalue"].endswith("): push a value that can, or make it in a cell of the session"), pushed.error
    hiding = kernel.execute("#pragma taas --ranks 0\nlist = [1, 2]\nsum = 3").ok()
    assert hiding.stderr == (
        "taas: list, sum came back from rank 0 and now hide Python's builtins of the same name in the notebook: "
        "del list brings each back\n"
    ), hiding.stderr
    assert kernel.execute("#pragma taas --ranks 0\nlist = [3]").ok().stderr == "", "it hid the builtin already"
    kernel.execute("del list, sum").ok()

    kernel.execute("step = 'from the notebook'\n%taas push step --ranks 1").ok()
    result = kernel.execute("#pragma taas --return none\nprint(taas.rank(), step)").ok()
    assert sorted(result.each_rank().splitlines()) == ["[rank 0] 0 0", "[rank 1] 1 from the notebook", "[rank 2] 2 20"]
    kernel.execute("%taas push step").ok()
    result = kernel.execute("#pragma taas --return none\nprint(taas.rank(), step)").ok()
    assert sorted(result.each_rank().splitlines()) == [f"[rank {rank}] {rank} from the notebook" for rank in range(3)]

    kernel.execute("%taas pull x\nshards = x").ok()
    kernel.execute("%taas push shards --ranks 0").ok()
    result = kernel.execute("#pragma taas --ranks 0 --return none\nprint(type(shards).__name__, float(shards[2]))").ok()
    assert result.stdout.strip().endswith("PerRank 2.0"), "a PerRank goes as it is: taas.PerRank is importable in ranks"

    result = kernel.execute("#pragma taas --ranks 1,2 --from all\ny = taas.rank() + 100").ok()
    assert kernel.value("(y.ranks, list(y))") == ((1, 2), [101, 102])
    result = kernel.execute("#pragma taas --ranks 1,2 --from 0\ny = 1")
    assert "--from 0: the cell (--ranks 1,2) has ranks 1-2, not rank 0" in result.traceback

    cells = kernel.execute("%taas").ok().stdout.split(" cells run")[0].rsplit(" ", 1)[1]
    assert kernel.execute("#pragma taas --ranks 1\nraise ValueError('here')").error is not None
    kernel.execute("%taas pull step").ok()
    kernel.execute("%taas push step --ranks 2").ok()
    debugged = kernel.execute("%taas debug", answers=["p step", "q"]).ok()
    assert "[rank 1] 'from the notebook'" in debugged.each_rank(), "a pull or push leaves the failed rank to debug"
    assert f"{int(cells) + 1} cells run" in kernel.execute("%taas").ok().stdout, "pull and push are not cells"
    kernel.execute("%taas stop").ok()


@pytest.mark.parametrize(
    "line, message",
    [
        ("%taas pull", "%taas pull NAMES [--ranks RANKS]: name at least one name"),
        ("%taas pull 1x", "'1x' is not a name"),
        ("%taas push x --ranks 9", "--ranks 9: the session has ranks 0-1"),
        ("%taas pull x --ranks 5", "--ranks 5: the session has ranks 0-1, not rank 5"),
        ("%taas pull x --ranks 0-1000000", "--ranks 0-1000000: the session has ranks 0-1, not rank 2"),
        (
            "%taas push x --ranks 99999999999999999999",
            "--ranks 99999999999999999999: the session has ranks 0-1, not rank 99999999999999999999",
        ),
        ("%taas debug 5", "%taas debug 5: the session has ranks 0-1, not rank 5"),
        ("%taas pull x --upto 2", "'--upto' is not allowed here"),
        ("%taas push not_in_the_notebook", "%taas push not_in_the_notebook: the notebook has no name"),
        ("%taas pull __builtins__", "'__builtins__' is the kernel's own name"),
        ("%taas pull __name__", "'__name__' is the kernel's own name"),
        ("%taas push In", "'In' is the kernel's own name"),
    ],
)
def test_bad_pull_and_push_are_one_line(kernel, line, message):
    kernel.execute("x = 1").ok()
    result = kernel.execute("#pragma taas --gpus 2 --keep --return none\nx = 2").ok()
    try:
        result = kernel.execute(line)
        assert message in result.traceback, result.traceback
        assert result.traceback.count("\n") <= 1
        assert kernel.execute("print('builtins', __name__)").ok().stdout == "builtins __main__\n"
        assert kernel.execute("#pragma taas\nprint('ranks', x)").ok().each_rank().count("] ranks 2") == 2
    finally:
        kernel.execute("%taas stop").ok()


def test_pull_without_a_session_says_how_names_come_back(kernel):
    result = kernel.execute("%taas pull x")
    assert (
        "%taas pull: no session is running (a taas cell with --keep starts one); a one-shot cell sends names "
        "back with --return NAMES --from RANKS" in result.traceback
    )


def test_a_registered_loader_pulled_from_a_session_is_named_as_the_ranks_stand_in(fresh_kernel):
    kernel = fresh_kernel
    kernel.execute(
        "import taas\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "loader = DataLoader(TensorDataset(torch.arange(8.)), batch_size=2)\ntaas.register(loader)"
    ).ok()
    kernel.execute("#pragma taas --gpus 2 --keep --return none\nseen = [batch[0].tolist() for batch in loader]").ok()
    try:
        result = kernel.execute("%taas pull loader seen").ok()
        assert result.stderr == (
            "taas: not copied back from ranks 0-1: loader (a registered loader's stand-in, which "
            "exists only inside the job: the notebook has the loader itself)\n"
        )
        assert kernel.value("(type(loader).__name__, list(seen))") == (
            "DataLoader",
            [[[0.0, 1.0], [4.0, 5.0]], [[2.0, 3.0], [6.0, 7.0]]],
        )
    finally:
        kernel.execute("%taas stop").ok()


def test_large_values_pulled_from_every_rank_arrive_whole(fresh_kernel):
    """Names larger than a message go from each rank to the kernel in a memory file, checked on arrival."""
    kernel = fresh_kernel
    kernel.execute(
        "#pragma taas --gpus 3 --keep --return none\nimport taas\n"
        "big = torch.arange(300_000, dtype=torch.float64) * (taas.rank() + 1)\nsmall = taas.rank()"
    ).ok()
    try:
        for _ in range(2):
            kernel.execute("%taas pull big small").ok()
            assert kernel.value("[float(b.sum()) for b in big]") == [sum(range(300_000)) * (r + 1) for r in range(3)]
            assert kernel.value("list(small)") == [0, 1, 2]
        kept = kernel.value(
            "[os.readlink(f'/proc/self/fd/{fd}') for fd in os.listdir('/proc/self/fd') "
            "if os.path.exists(f'/proc/self/fd/{fd}')]"
        )
        assert not [name for name in kept if "taas-names" in name], "the kernel keeps no file of the names it read"
    finally:
        kernel.execute("%taas stop").ok()
