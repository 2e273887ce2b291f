"""Rank 0's names as the kernel receives them: one bad name never costs the others, sharing is kept."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from taas_magic.wire import memfile, results


def round_trip(values: dict) -> tuple[dict, dict]:
    """What the notebook gets: (names back, {name: why} for the rest, from either side), the names carried
    as they travel on one machine: in a sealed memory file the kernel maps."""
    data, skipped = results.dumps(values)
    back, lost = results.loads(mapped(data))
    assert not set(skipped) & set(lost)
    return back, {**skipped, **lost}


class RaisesOnReduce:
    def __init__(self, error: BaseException):
        self.error = error

    def __reduce__(self):
        raise self.error


class RaisesOnGetstate:
    def __getstate__(self):
        raise LookupError("no state today")


class Endless:
    """Each pickling makes a new one to pickle: the pickler recurses until it gives up."""

    def __reduce__(self):
        return (Endless, (), Endless())


class UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("cannot even say why")


def refuse_here(message: str):
    raise ValueError(message)


class UnpicklesNowhere:
    """Pickles fine; unpickling raises, as a class only the rank can import would."""

    def __reduce__(self):
        return (refuse_here, ("not in this process",))


def numbers():
    yield 1


class _NameRaisesMeta(type):
    @property
    def __name__(cls):
        raise RuntimeError("no name for you")


class NameRaises(metaclass=_NameRaisesMeta):
    """A class whose metaclass answers __name__ with an error, and whose instances refuse pickling."""

    def __reduce__(self):
        raise TypeError("no pickling")


@pytest.mark.parametrize(
    "value, why",
    [
        (RaisesOnReduce(ValueError("bad value")), "RaisesOnReduce cannot be pickled (ValueError: bad value)"),
        (RaisesOnReduce(SystemExit(3)), "RaisesOnReduce cannot be pickled (SystemExit: 3)"),
        (RaisesOnReduce(GeneratorExit()), "RaisesOnReduce cannot be pickled (GeneratorExit)"),
        (RaisesOnReduce(MemoryError()), "RaisesOnReduce cannot be pickled (MemoryError)"),
        (RaisesOnReduce(UnprintableError()), "RaisesOnReduce cannot be pickled (UnprintableError)"),
        (RaisesOnGetstate(), "RaisesOnGetstate cannot be pickled (LookupError: no state today)"),
        (
            Endless(),
            "Endless cannot be pickled (PicklingError: Could not pickle object as excessively deep recursion "
            "required.)",
        ),
        (numbers(), "generator cannot be pickled (TypeError: cannot pickle 'generator' object)"),
        (threading.Lock(), "lock cannot be pickled (TypeError: cannot pickle '_thread.lock' object)"),
        (NameRaises(), "NameRaises cannot be pickled (TypeError: no pickling)"),
    ],
)
def test_any_value_that_cannot_be_pickled_is_named_with_why_and_the_others_come_back(value, why):
    back, left_out = round_trip({"before": [1, 2], "bad": value, "after": "kept"})
    assert back == {"before": [1, 2], "after": "kept"}
    assert left_out == {"bad": why}


def test_open_files_and_sockets_are_named_and_the_others_come_back(tmp_path):
    with open(tmp_path / "log.txt", "w") as log, socket.socket() as sock:
        back, left_out = round_trip({"log": log, "sock": sock, "value": 42})
    assert back == {"value": 42}
    assert left_out["log"].startswith("TextIOWrapper cannot be pickled (")
    assert left_out["sock"] == "socket cannot be pickled (TypeError: cannot pickle 'socket' object)"


def test_a_name_that_cannot_be_unpickled_is_left_out_alone_and_what_shares_with_it_too():
    shared = [1, 2]
    broken = UnpicklesNowhere()
    back, left_out = round_trip(
        {
            "first": {"shared": shared},
            "bad": {"broken": broken},
            "holder": [broken, "x"],
            "later": [shared, 3],
            "plain": 7,
        }
    )
    assert left_out == {
        "bad": "could not be unpickled in the kernel (ValueError: not in this process)",
        "holder": "shares objects with bad, which could not be unpickled in the kernel",
    }
    assert back == {"first": {"shared": [1, 2]}, "later": [[1, 2], 3], "plain": 7}
    assert back["later"][0] is back["first"]["shared"], "objects shared across names are still shared"


def test_a_model_and_its_optimizer_still_share_parameters_after_a_failure_between_them():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    back, left_out = round_trip({"model": model, "bad": UnpicklesNowhere(), "optimizer": optimizer})
    assert list(left_out) == ["bad"]
    assert back["optimizer"].param_groups[0]["params"][0] is back["model"].weight
    assert torch.equal(back["model"].weight, model.weight)


def test_huge_values_come_back_whole_beside_a_failing_one():
    big = torch.arange(8_000_000, dtype=torch.float32)  # 32 MB
    back, left_out = round_trip({"big": big, "bad": UnpicklesNowhere(), "blob": b"x" * 20_000_000})
    assert list(left_out) == ["bad"]
    assert torch.equal(back["big"], big)
    assert back["blob"] == b"x" * 20_000_000


def test_nothing_to_send_and_everything_left_out():
    assert results.loads(b"") == ({}, {})
    back, left_out = round_trip({"lock": threading.Lock()})
    assert back == {} and list(left_out) == ["lock"]


def test_names_that_only_reuse_strings_or_globals_of_a_failed_name_still_come_back():
    broken = UnpicklesNowhere()
    back, left_out = round_trip(
        {
            "bad": {"not in this process": broken, "key": refuse_here},
            "reuses": {"not in this process": 1, "key": refuse_here},
        }
    )
    assert list(left_out) == ["bad"]
    assert back == {"reuses": {"not in this process": 1, "key": refuse_here}}


def test_a_name_rank_0_never_bound_is_worth_saying_only_when_return_asked_for_it():
    skipped = {
        "t0": results.NOT_BOUND,
        "lock": "lock cannot be pickled (TypeError: cannot pickle '_thread.lock' object)",
    }
    assert results.worth_saying(skipped, None) == {"lock": skipped["lock"]}
    assert results.worth_saying(skipped, ("t0", "lock")) == skipped


def mapped(packed: results.Packed) -> results.Received:
    """``packed`` written to a sealed memory file and received, as the kernel's end of a run receives it."""
    fd = memfile.new_file("test-names", packed.size)
    try:
        packed.write(fd)
        memfile.seal(fd)
        assert memfile.sealed(fd) is not False
        return results.receive_file(fd, packed.size)
    finally:
        os.close(fd)


def sent(**values):
    """(bytes the names took, the names back), carried as bytes in a message (small names, cluster nodes)."""
    data, skipped = results.dumps(values)
    assert not skipped, skipped
    return data.size, results.loads(data.to_bytes())[0]


def test_a_small_view_of_a_large_tensor_comes_back_as_its_elements_not_the_storage():
    big = torch.arange(4_000_000, dtype=torch.float32)  # 16 MB
    size, back = sent(head=big[:3], column=big.view(2000, 2000)[:, 7])
    assert size < 100_000, f"{size} bytes for 2003 numbers"
    assert torch.equal(back["head"], big[:3]) and torch.equal(back["column"], big.view(2000, 2000)[:, 7])
    assert back["column"].is_contiguous()


def test_a_view_that_uses_most_of_its_storage_is_sent_as_it_is():
    big = torch.zeros(2_000_000)
    size, back = sent(most=big[:1_500_000], small=torch.arange(1000.0)[:10])
    assert size > 6_000_000 and back["most"].shape == (1_500_000,), "three quarters of the storage: sent as it is"
    assert torch.equal(back["small"], torch.arange(10.0)), "less than a megabyte left out: sent as it is"


def test_a_forward_outputs_backward_hooks_are_left_out_without_a_warning(recwarn):
    weight = torch.ones(3, requires_grad=True)
    out = (weight * 2).detach().requires_grad_()
    out.register_hook(lambda grad: grad)
    size, back = sent(out=out)
    assert torch.equal(back["out"], out.detach())
    assert not [w for w in recwarn if "will not be serialized" in str(w.message)]
