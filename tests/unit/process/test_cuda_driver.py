"""Whether the kernel holds the CUDA driver open (process/machine.py), read from its descriptors."""

from __future__ import annotations

import os

from taas_magic.process.machine import cuda_driver_open, cuda_initialized_in_kernel


def test_a_process_that_holds_the_drivers_unified_memory_device_open_has_initialized_cuda(tmp_path) -> None:
    descriptors, device = tmp_path / "fd", tmp_path / "nvidia-uvm"
    descriptors.mkdir()
    device.touch()  # the device node, as a machine with the NVIDIA driver has it
    os.symlink("/dev/null", descriptors / "0")
    os.symlink("/dev/nvidiactl", descriptors / "3")  # NVML (the live view's) opens this one, not the next
    assert not cuda_driver_open(str(descriptors), str(device))
    os.symlink(device, descriptors / "7")
    assert cuda_driver_open(str(descriptors), str(device))


def test_no_device_or_no_descriptors_to_read_is_no_driver(tmp_path) -> None:
    descriptors = tmp_path / "fd"
    descriptors.mkdir()
    os.symlink(tmp_path / "nvidia-uvm", descriptors / "7")
    assert not cuda_driver_open(str(descriptors), str(tmp_path / "nvidia-uvm")), "no such device on this machine"
    (tmp_path / "nvidia-uvm").touch()
    assert not cuda_driver_open(str(tmp_path / "gone"), str(tmp_path / "nvidia-uvm"))


def test_this_machine_without_a_gpu_driver_has_none_open() -> None:
    assert not cuda_driver_open() and not cuda_initialized_in_kernel()
