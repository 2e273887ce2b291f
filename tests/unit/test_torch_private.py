"""torch's private functions that taas uses are there in this torch; where one is not, each caller goes on."""

from __future__ import annotations

import types

import torch

from taas_magic import torch_private


def test_every_private_function_taas_uses_is_in_this_torch():
    assert torch_private.missing(torch) == [], (
        f"torch {torch.__version__} lacks {torch_private.missing(torch)}: see taas_magic/process/torch_private.py "
        "for what each is used for and what happens without it"
    )


def test_the_flight_recorder_dumps_read_as_pickles_of_what_the_hang_doctor_reads():
    import pickle

    readers = torch_private.flight_recorder_dumps()
    assert readers
    for reader in readers:
        try:
            dump = pickle.loads(reader(False, False, False))
        except Exception:  # a ring of size 0 in this process, or nothing recorded for the backend
            continue
        assert isinstance(dump, dict)


def test_a_torch_without_them_is_answered_not_known():
    bare = types.SimpleNamespace(cuda=types.SimpleNamespace(), _C=types.SimpleNamespace())
    assert torch_private.device_count_nvml(bare) is None
    assert torch_private.in_bad_fork(bare) is None
    assert torch_private.missing(bare)[:2] == ["torch.cuda._device_count_nvml", "torch._C._cuda_isInBadFork"]


def test_a_failing_nvml_count_is_not_known_rather_than_an_error():
    def fails() -> int:
        raise RuntimeError("NVML library not found")

    broken = types.SimpleNamespace(cuda=types.SimpleNamespace(_device_count_nvml=fails), _C=types.SimpleNamespace())
    assert torch_private.device_count_nvml(broken) is None
    negative = types.SimpleNamespace(cuda=types.SimpleNamespace(_device_count_nvml=lambda: -1))
    assert torch_private.device_count_nvml(negative) is None


def test_this_process_is_no_bad_fork():
    assert torch_private.in_bad_fork(torch) is False


def test_a_torch_without_version_counters_reads_every_tensor_as_changed():
    bare = types.SimpleNamespace()
    assert torch_private.version_counter(bare) != torch_private.version_counter(bare)
    t = torch.zeros(2)
    before = torch_private.version_counter(t)
    t.add_(1)
    assert torch_private.version_counter(t) == before + 1


def test_a_group_destroyed_or_unknown_to_this_torch_is_not_taken_for_a_live_one():
    dist = types.SimpleNamespace(distributed_c10d=types.SimpleNamespace())
    assert torch_private.group_exists(dist, object()) is False
    assert torch_private.fsdp_managed(torch.nn.Linear(2, 2)) is None  # not an FSDP2 unit
