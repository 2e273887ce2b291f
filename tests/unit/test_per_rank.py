"""taas.PerRank, the value of a name brought back from several ranks; the rank lists of --from, --ranks and
%taas pull/push."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.notebook_values import SETUP, TORCH_WARNINGS_OF_TENSORS
from support.notebook_values import values as notebook_values

import taas
from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header import option_values, options
from taas_magic.kernel.header.spec import return_from
from taas_magic.per_rank import PerRank, span

pytestmark = TORCH_WARNINGS_OF_TENSORS  # the generated notebook values include quantized and complex32 tensors


def test_it_reads_like_the_list_of_the_ranks_values_indexed_by_rank() -> None:
    values = PerRank({2: "c", 0: "a", 1: "b"})
    assert (values.ranks, list(values), len(values), values[1]) == ((0, 1, 2), ["a", "b", "c"], 3, "b")
    assert values.items() == [(0, "a"), (1, "b"), (2, "c")]
    assert taas.PerRank is PerRank and type(values).__module__ == "taas"


def test_a_rank_it_does_not_hold_is_an_error_naming_those_it_holds() -> None:
    with pytest.raises(KeyError, match="0 is not a rank of this value: it holds ranks 1,3"):
        PerRank({1: "b", 3: "d"})[0]
    with pytest.raises(KeyError, match="'a' is not a rank"):
        PerRank({1: "b"})["a"]  # type: ignore[index]


def test_identical_values_show_once_with_their_ranks() -> None:
    assert repr(PerRank({rank: torch.tensor(3.0) for rank in range(8)})) == "ranks 0-7: tensor(3.)"
    assert repr(PerRank({0: 1, 1: 2, 2: 1, 3: 1})) == "ranks 0,2-3: 1\nrank 1: 2"
    assert repr(PerRank({0: torch.zeros(2, 2)})) == "rank 0:\n    tensor([[0., 0.],\n            [0., 0.]])"
    assert repr(PerRank({})) == "PerRank(no ranks)"


def test_equal_when_the_same_ranks_hold_equal_values_tensors_by_value() -> None:
    assert PerRank({0: torch.ones(2), 1: 2}) == PerRank({0: torch.ones(2), 1: 2})
    assert PerRank({0: torch.ones(2)}) != PerRank({0: torch.zeros(2)})
    assert PerRank({0: 1}) != PerRank({1: 1})
    assert PerRank({0: torch.ones(2)}) != PerRank({0: torch.ones(2, dtype=torch.int64)})


def test_it_pickles_as_taas_per_rank() -> None:
    values = PerRank({0: [1], 3: {"a": 2}})
    assert b"taas" in pickle.dumps(values) and pickle.loads(pickle.dumps(values)) == values


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no")


_NOTEBOOK: dict = {}
exec(SETUP, _NOTEBOOK)


@given(st.dictionaries(st.integers(0, 64), notebook_values(), max_size=12))
def test_any_values_show_every_rank_once_and_never_raise(expressions) -> None:
    values = {rank: eval(expression, _NOTEBOOK) for rank, expression in expressions.items()}
    per_rank = PerRank({**values, 65: _BadRepr()})
    shown = repr(per_rank)
    heads = [line.split(":")[0] for line in shown.splitlines() if line.startswith("rank")]
    covered = [rank for head in heads for rank in _ranks_of(head)]
    assert sorted(covered) == sorted(per_rank.ranks)
    assert "<_BadRepr whose repr raised RuntimeError>" in shown
    assert list(per_rank) == [per_rank[rank] for rank in per_rank.ranks]


def _ranks_of(head: str) -> list[int]:
    ranks = []
    for run in head.split(" ", 1)[1].split(","):
        low, _, high = run.partition("-")
        ranks.extend(range(int(low), int(high or low) + 1))
    return ranks


@given(st.sets(st.integers(0, 200), min_size=1))
def test_span_and_rank_lists_read_each_other(ranks) -> None:
    text = span(ranks).split(" ", 1)[1]
    assert option_values.rank_list(text) == tuple(sorted(ranks))


@pytest.mark.parametrize(
    "text, ranks", [("0", (0,)), ("0,2", (0, 2)), ("0-3", (0, 1, 2, 3)), ("4,0-1", (4, 0, 1)), (" 1 , 2 ", (1, 2))]
)
def test_rank_lists_take_numbers_commas_and_ranges(text, ranks) -> None:
    assert option_values.rank_list(text) == ranks


@pytest.mark.parametrize("text", ["", "a", "-1", "1-", "3-1", "1,,2", "1.5", "0-2,2", "²"])
def test_anything_else_is_not_a_rank_list(text) -> None:
    with pytest.raises(Exception, match="is not a list of ranks|names a rank twice"):
        option_values.rank_list(text)


def test_from_is_all_or_ranks_of_the_run() -> None:
    assert option_values.ranks_or_all("ALL") == "all"
    assert return_from(None, range(4), "the run") == (0,)
    assert return_from("all", range(4), "the run") == (0, 1, 2, 3)
    assert return_from((3, 1), range(4), "the run") == (1, 3)
    with pytest.raises(TaasUsageError, match="--from 4: the run has ranks 0-3, not rank 4"):
        return_from((4,), range(4), "the run")


@pytest.mark.parametrize(
    "words, parsed",
    [
        (["x"], (("x",), None)),
        (["x,y", "z", "x"], (("x", "y", "z"), None)),
        (["x", "--ranks", "0-1"], (("x",), (0, 1))),
        (["--ranks", "2", "x"], (("x",), (2,))),
    ],
)
def test_pull_and_push_take_names_and_ranks(words, parsed) -> None:
    assert options.transfer("pull", words) == parsed


@pytest.mark.parametrize(
    "words, message",
    [
        ([], "name at least one name"),
        (["1x"], "'1x' is not a name"),
        (["x", "--ranks"], r"--ranks needs its ranks \(--ranks 0,2 or --ranks 0-3\)$"),
        (["x", "--ranks", "a"], "--ranks 'a' is not a list of ranks"),
        (["x", "-v"], "'-v' is not allowed here: the one option is --ranks RANKS$"),
        (["x", "--from", "1"], "'--from' is not allowed here: the one option is --ranks RANKS$"),
        (["x", "--", "y"], "'--' is not allowed here: the one option is --ranks RANKS$"),
        (["x", "--ranks", "1", "--ranks", "2"], "--ranks is given twice: give it once$"),
    ],
)
def test_bad_pull_words_are_one_line(words, message) -> None:
    with pytest.raises(TaasUsageError, match=message) as raised:
        options.transfer("pull", words)
    assert "\n" not in str(raised.value)


KERNELS_OWN = [
    "__builtins__",
    "__name__",
    "__doc__",
    "In",
    "Out",
    "get_ipython",
    "exit",
    "quit",
    "_",
    "__",
    "___",
    "_i",
    "_ii",
    "_iii",
    "_i7",
    "_7",
    "_ih",
    "_oh",
    "_dh",
]


@pytest.mark.parametrize("name", KERNELS_OWN)
@pytest.mark.parametrize("command", ["pull", "push"])
def test_no_name_of_the_kernels_own_moves(command, name) -> None:
    """`%taas pull __builtins__` once replaced the notebook's builtins: every later cell failed on `print`."""
    with pytest.raises(TaasUsageError, match=f"'{name}' is the kernel's own name") as raised:
        options.transfer(command, ["x", f"y,{name}"])
    assert "\n" not in str(raised.value)
    with pytest.raises(Exception, match=f"'{name}' is the kernel's own name"):
        option_values.names_or_none(f"model,{name}")


@given(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True))
def test_any_other_name_moves(name) -> None:
    """Whatever a person calls a value moves, unless Python or IPython keeps a name of that shape."""
    own = option_values.kernels_own(name)
    assert own == (
        name in KERNELS_OWN or (name.startswith("__") and name.endswith("__")) or bool(re.fullmatch(r"_i?\d+", name))
    )
    if own:
        with pytest.raises(TaasUsageError):
            options.transfer("pull", [name])
    else:
        assert options.transfer("pull", [name]) == ((name,), None)
        assert option_values.names_or_none(name) == (name,)


def test_ranks_out_of_range_are_quoted_as_typed() -> None:
    with pytest.raises(
        TaasUsageError, match="^--from 99999999999999999999: the run has ranks 0-1, not rank 99999999999999999999$"
    ):
        return_from(option_values.rank_list("99999999999999999999"), range(2), "the run")
    with pytest.raises(TaasUsageError, match="^--ranks 1-3,7: the session has ranks 0-3, not rank 7$"):
        return_from(option_values.rank_list(" 1-3,7"), range(4), "the session", "--ranks")
