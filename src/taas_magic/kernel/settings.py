"""What `%taas` alone shows, what a lone `#!NAME` line warns about, and the defaults a cell's options
fall back on (`%config TaasMagics.device = "cpu"`, or ipython_config.py)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from taas_magic.configurations import load_catalog
from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header import options
from taas_magic.kernel.header.option_values import count
from taas_magic.kernel.header.options import Device, OldStart, Output, Start
from taas_magic.kernel.running import profiling
from taas_magic.kernel.sessions import reloading
from taas_magic.kernel.sessions.session import Session
from taas_magic.launch.forkserver.client import ForkServerBackend
from taas_magic.process import machine
from taas_magic.version import VERSION

CONFIGURABLE = ("device", "output", "start", "view", "hang_after")  # the TaasMagics traits a user may set


@dataclass(frozen=True)
class Defaults:
    """The magic's configurable defaults, and which of them the user set."""

    device: Device | None  # None: $TAAS_DEVICE, else auto
    output: Output
    start: Start | OldStart
    view: bool  # the live view of a run
    hang_after: float  # the default --hang-after (0: the watchdog is off)
    configured: frozenset[str]  # the names set with %config or in ipython_config.py

    @classmethod
    def of(
        cls,
        device: Device | None,
        output: Output,
        start: Start | OldStart,
        view: bool,
        hang_after: float,
        config: Config,
    ) -> "Defaults":
        # The configuration says what the user set, not ``trait_has_value``: that turns true once the
        # built-in default is read.
        return cls(
            device,
            output,
            start,
            view,
            hang_after,
            frozenset(name for name in CONFIGURABLE if f"TaasMagics.{name}" in config),
        )

    def fill_in(self, args: argparse.Namespace) -> argparse.Namespace:
        """The options the cell left out, from these defaults: an option in the cell wins, then the
        configuration, then $TAAS_DEVICE."""
        args.output = args.output or self.output
        args.start = args.start or self.start
        if args.hang_after is None:
            args.hang_after = self.hang_after
        if args.device is None:
            args.device = self.device
        return args

    def _from_config(self, name: str) -> str:
        """Where a default came from, when the user configured it."""
        return f" (from %config TaasMagics.{name})" if name in self.configured else ""

    def describe(
        self,
        fork_server: ForkServerBackend,
        session: Session | None,
        shell: InteractiveShell,
        cluster: str,
        background: str = "none (--background starts one)",
    ) -> str:
        """`%taas` alone: how cells start, what runs, and each default with where it came from."""
        catalog = load_catalog()
        found = machine.detect()
        try:
            device: str = options.default_device()
        except TaasUsageError as e:
            device = f"invalid ({e})"
        names = ", ".join(catalog.names())
        return "\n".join(
            [
                f"taas-magic:          {VERSION}",
                "start:               fork from this kernel; the fork server once CUDA was used here",
                f"fork server:         {fork_server.describe()}",
                "session:             " + (session.describe() if session is not None else "none (--keep starts one)"),
                f"session modules:     {reloading.describe(shell)}",
                f"in the background:   {background}",
                f"cluster:             {cluster}",
                f"configurations:      {'; '.join(catalog.sources)}",
                f"                     {names}",
                f"CUDA devices:        {found.cuda_devices} visible" + _cuda_used_here(),
                f"--profile traces:    {_traces_here()}",
                f"CPU cores:           {found.cpus}",
                f"default --device:    {self.device} (from %config TaasMagics.device)"
                if self.device
                else f"default --device:    {device} (from TAAS_DEVICE)"
                if os.environ.get("TAAS_DEVICE")
                else f"default --device:    {device}",
                "default --gpus:      the configuration's GPUs per node, else 1",
                "default --output:    "
                + (
                    "all (each line labelled with its rank)"
                    if self.output == "all"
                    else "rank0 (rank 0's output alone)"
                )
                + self._from_config("output"),
                "live view:           "
                + (
                    "on (a row per rank; bars in their row; identical lines of several ranks once)"
                    if self.view
                    else "off (the ranks' output as they write it)"
                )
                + self._from_config("view"),
                "default --timeout:   none",
                "default --hang-after: "
                + (f"{self.hang_after:g} s" if self.hang_after else "0 (no watchdog)")
                + self._from_config("hang_after"),
                f"default --start:     {self.start}" + self._from_config("start"),
                "default --return:    every name the cell binds at top level (rank 0's values)",
                "default --cpus:      1 producer per registered loader the cell uses (0: no data delivery)",
            ]
        )


def check_configuration(name: str) -> None:
    """`#!NAME` alone: the cell runs here; warn in one line if this machine lacks what NAME needs."""
    configuration = load_catalog().get(name)
    found = machine.detect()
    if configuration.gpus and found.cuda_devices < configuration.gpus:
        print(
            f"taas: {name} needs {count(configuration.gpus, 'GPU')}, this machine has {found.cuda_devices}: "
            "running the cell in the kernel anyway",
            file=sys.stderr,
        )
    elif not configuration.gpus and found.cpus < configuration.cpus:
        print(
            f"taas: {name} needs {count(configuration.cpus, 'vCPU')}, this machine has {found.cpus}: "
            "running the cell in the kernel anyway",
            file=sys.stderr,
        )


def _traces_here() -> str:
    """The merged traces ``--profile`` runs left in the notebook's folder: they are the user's to delete."""
    number, size = profiling.kept_traces(os.getcwd())
    if not number:
        return "none in this folder"
    return f"{count(number, 'trace')}, {size / 1e6:.1f} MB, in this folder ({profiling.PREFIX}*{profiling.SUFFIX})"


def _cuda_used_here() -> str:
    """What CUDA already used in the kernel means for the next cells, as the choice of start decides.

    A CUDA context makes any fork unsafe; a lighter use (``torch.cuda.is_available()``) only
    leaves forked ranks unable to use CUDA, so CPU cells still fork.
    """
    if machine.cuda_initialized_in_kernel():
        return " (CUDA is initialized in this kernel: ranks start from the fork server)"
    if machine.fork_poisoned_for_cuda():
        return " (CUDA was used in this kernel: GPU cells start from the fork server; CPU cells still fork)"
    return ""
