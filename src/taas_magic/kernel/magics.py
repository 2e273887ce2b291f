"""`%%taas` and `%taas`: IPython's glue to a run. Parse → spec → run → report.

What the magic does is elsewhere, one job per module: the cell's run (``runner``), what outlives a
cell and `%taas stop` / `%taas debug` (``kept``), where a session's ranks are for `%taas stacks`
(``session``), the cluster and `%taas cluster` (``cluster_link``), `%taas` alone and the
configurable defaults (``settings``), reading and compiling the cell (``cell_source``). The
``%config`` traits stay here, where IPython looks for them.
"""

from __future__ import annotations

import os
from typing import Any

from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, magics_class, no_var_expand
from traitlets import Bool, Enum, Float, TraitError, validate

from taas_magic.errors import TaasUsageError
from taas_magic.kernel import settings
from taas_magic.kernel.cluster_link import ClusterLink
from taas_magic.kernel.debugging.visual_debugger import RankDebugging
from taas_magic.kernel.header import cell_source, line_commands, options
from taas_magic.kernel.header.pragma import PragmaTransformer
from taas_magic.kernel.runner import CellRunner
from taas_magic.kernel.running.background import BackgroundRun
from taas_magic.kernel.sessions.kept import Kept
from taas_magic.launch.cluster import connection
from taas_magic.launch.fork.backend import ForkBackend
from taas_magic.launch.forkserver.client import ForkServerBackend
from taas_magic.process import cell_files
from taas_magic.version import VERSION


@magics_class
class TaasMagics(Magics):
    """Runs a cell as a distributed PyTorch job; see `%%taas?`.

    Its defaults are configurable as IPython's are: `%config TaasMagics.device = "cpu"`, or
    `c.TaasMagics.device = "cpu"` in ipython_config.py. An option in the cell wins over them.
    """

    device = Enum(
        options.DEVICES,
        default_value=None,
        allow_none=True,
        config=True,
        help="The default --device (None: $TAAS_DEVICE, else auto).",
    )
    output = Enum(options.OUTPUTS, default_value="all", config=True, help="The default --output.")
    start = Enum(options.STARTS, default_value="auto", config=True, help="The default --start.")
    view = Bool(
        True,
        config=True,
        help="The live view of a run (a row per rank, bars in place, identical lines "
        "of several ranks once); False: the ranks' output as they write it.",
    )
    warm_fork_server = Bool(
        True,
        config=True,
        help="Start the fork server as the extension loads, so that the first forkserver cell finds torch "
        "imported (the server costs a few seconds of CPU and a few hundred MB while it waits); False: it starts "
        "with the first cell that needs it. Read at %load_ext: set it in ipython_config.py or on the kernel's "
        "command line (--TaasMagics.warm_fork_server=False).",
    )
    hang_after = Float(
        120.0,
        config=True,
        help="The default --hang-after: seconds without progress after which a "
        "run says where each rank waits and why (0: never).",
    )

    @validate("hang_after")
    def _valid_hang_after(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0 <= value < float("inf"):
            raise TraitError(
                f"TaasMagics.hang_after = {value!r} is not allowed: use a number of seconds greater "
                "than 0, or 0 to turn the watchdog off"
            )
        return value

    def __init__(self, shell: InteractiveShell, transformer: PragmaTransformer):
        super().__init__(shell)
        self.ipython = shell  # the same as Magics.shell, never None here
        self.transformer = transformer
        self.fork_backend = ForkBackend()
        self.forkserver_backend = ForkServerBackend()  # kept warm between cells
        self.link = ClusterLink(connection.address_from(os.environ))  # the cluster cells run on, if any
        self.kept = Kept()  # the session of `--keep`, or a rank paused by --debug, between cells
        self.debugging = RankDebugging.of(shell)  # ranks in the notebook's visual debugger, when it has one

    @options.declare
    @no_var_expand  # done in the magic, only where there is something to expand (cell_source.expand_variables)
    @line_cell_magic
    def taas(self, line: str, cell: str | None = None) -> BackgroundRun | None:
        """Run this cell as a distributed PyTorch job: one process (rank) per GPU.

        Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
        MASTER_PORT, ...), so `torch.distributed.init_process_group("nccl", init_method="env://")`
        works unchanged and Lightning needs no init. `#!g2.8` / `#pragma taas --gpus 8` at the
        top of a cell means `%%taas --config g2.8 --gpus 8`. `%taas` alone shows the settings.

        `--keep` starts a session: the ranks stay, and the taas cells that follow run in them
        (`--ranks 0,2` in part of them); `breakpoint()` works in ranks, and with the notebook's visual
        debugger on they stop at its breakpoints. The line `%taas` takes the commands below
        (`%taas help` lists them too).
        """
        line = cell_source.expand_variables(self.ipython, line)
        if cell is None:
            self._line(line.split(), line)
            return None
        args = options.parse(TaasMagics.taas, line)
        cell_source.refuse_typed_internal_options(args, self.ipython, TaasMagics.taas)
        return self._runner().run(args, self._defaults(), line, cell)  # a run in the background: its handle

    def _line(self, words: list[str], line: str) -> None:
        """`%taas ...` as a line: one of its commands (line_commands.py), each read before it acts."""
        cell_options = options.visible_options(TaasMagics.taas)
        command = line_commands.read(words, cell_options)
        if command in line_commands.COMMANDS and line_commands.asks_help(words):
            print(line_commands.help_text(cell_options, command))
            return
        rest = words[1:]
        if command == line_commands.CHECK:  # a lone `#!NAME` line (pragma.py), never typed by hand
            args = options.parse(TaasMagics.taas, line)
            cell_source.refuse_typed_internal_options(args, self.ipython, TaasMagics.taas)
            settings.check_configuration(args.check)
        elif command == "help":
            print(line_commands.help_text(cell_options, line_commands.help_command(rest)))
        elif command == "cluster":
            self.link.command(rest, self.kept)
        elif command == "stop":
            self.kept.stop_command(rest)
        elif command == "debug":
            self.kept.debug_command(rest)
        elif command == "resize":
            self.kept.resize_command(rest)
        elif command == "stacks":
            self._stacks_command(rest)
        elif command == "runs":
            line_commands.nothing_more(command, rest)
            print(self.kept.background.describe())
        elif command == "wait":
            line_commands.nothing_more(command, rest)
            self.kept.background.wait_all()
        elif command in ("pull", "push"):
            self._transfer_command(command, rest)
        elif command == "version":
            line_commands.nothing_more(command, rest)
            print(f"taas-magic {VERSION}")
        else:  # `%taas` alone, or `%taas status`
            line_commands.nothing_more("status", rest)
            print(
                self._defaults().describe(
                    self.forkserver_backend,
                    self.kept.session,
                    self.ipython,
                    self.link.describe(),
                    self.kept.background.summary(),
                )
            )

    def _stacks_command(self, words: list[str]) -> None:
        """`%taas stacks`: where each process of the session is, between its cells or while one runs in the
        background."""
        line_commands.nothing_more("stacks", words)
        session = self.kept.session
        if session is None:
            print("taas: no session is running (a taas cell with --keep starts one)")
            return
        print("\n".join(session.where(cell_files.cell_labels(self.ipython))))

    def _transfer_command(self, command: str, words: list[str]) -> None:
        """`%taas pull NAMES` / `%taas push NAMES`: names between the notebook and the session's ranks."""
        names, ranks = options.transfer(command, words)
        kept = self.kept.session
        running = kept.running_in_background() if kept is not None else None
        if command == "pull" and kept is not None and running is not None:
            if self._runner().pull_while_running(kept, running, names, ranks):
                return
            running.wait()  # its cell ended before every rank answered: from the session as the cell left it
        session = self.kept.live_session(command)
        if session is None:
            back = "; a one-shot cell sends names back with --return NAMES --from RANKS" if command == "pull" else ""
            raise TaasUsageError(f"%taas {command}: no session is running (a taas cell with --keep starts one){back}")
        runner = self._runner()
        (runner.pull if command == "pull" else runner.push)(session, names, ranks, self._defaults())

    def _runner(self) -> CellRunner:
        return CellRunner(
            self.ipython,
            self.transformer,
            self.link,
            self.kept,
            self.fork_backend,
            self.forkserver_backend,
            self.debugging,
        )

    def _defaults(self) -> settings.Defaults:
        return settings.Defaults.of(self.device, self.output, self.start, self.view, self.hang_after, self.config)

    def between_cells(self, *_: Any) -> None:
        """Before each cell of the notebook (IPython's ``pre_run_cell``): the runs in the background that ended
        bind their names, each said in one line."""
        self.kept.background.between_cells()

    # -- unloading and loading again ----------------------------------------------------------
    def take_over(self, old: Any) -> None:
        """``%reload_ext``: what the unloaded magics ran goes on here (the session, a rank paused by
        --debug, the cluster, the fork server) with their ``%config`` settings, as if nothing happened.
        ``old`` may be of this class as it was before the module was reloaded."""
        for name in ("fork_backend", "forkserver_backend", "link", "kept", "debugging"):
            setattr(self, name, getattr(old, name))
        self.update_config(old.config)

    def close(self, why: str) -> None:
        """End all these magics run, ``why`` (a session in one line). An ended session stays, so that the
        next taas cell says it ended instead of running as a one-shot cell."""
        self.kept.close(why)
        if self.debugging is not None:
            self.debugging.uninstall()
        self.forkserver_backend.shutdown()
        self.link.disconnect()  # its agents and their fork servers end with it
