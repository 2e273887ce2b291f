"""Whether the kernel holds the CUDA driver open (process/machine.py), read from its descriptors."""

from __future__ import annotations

import os

from taas_magic.process.machine import cuda_driver_open, cuda_initialized_in_kernel


def test_a_process_that_holds_the_drivers_unified_memory_device_open_has_initialized_cuda(tmp_path) -> None:
    os.symlink("/dev/null", tmp_path / "0")
    os.symlink("/dev/nvidiactl", tmp_path / "3")  # NVML (the live view's) opens this one, not the next
    assert not cuda_driver_open(str(tmp_path))
    os.symlink("/dev/nvidia-uvm", tmp_path / "7")
    assert cuda_driver_open(str(tmp_path))


def test_no_descriptors_to_read_is_no_driver(tmp_path) -> None:
    assert not cuda_driver_open(str(tmp_path / "gone"))


def test_this_machine_without_a_gpu_driver_has_none_open() -> None:
    assert not cuda_driver_open() and not cuda_initialized_in_kernel()
