"""`%%taas` and `%taas`: the glue from a cell to a run. Parse → spec → compile → run → report."""

from __future__ import annotations

import ast
import dataclasses
import functools
import linecache
import os
import re
import sys
from types import CodeType
from typing import Any, cast

from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, magics_class, no_var_expand
from traitlets import Bool, Enum

from taas_magic.launch.cluster import connection
from taas_magic.kernel import controller, options, streams
from taas_magic.process import machine
from taas_magic.kernel import reloading
from taas_magic.rank import plugins
from taas_magic.wire import results, shipping
from taas_magic.launch.backend import Backend, Cell, SessionGroup
from taas_magic.launch.cluster.connection import Cluster
from taas_magic.launch.cluster.backend import PRODUCER_NODE, ClusterBackend, ClusterRanks
from taas_magic.configurations import Catalog, load_catalog
from taas_magic.kernel import delivery_planning
from taas_magic.delivery.service import LoaderPlan, producer_labels
from taas_magic.errors import TaasUsageError
from taas_magic.launch.fork.backend import ForkBackend
from taas_magic.launch.forkserver.client import ForkServerBackend, ForkServerRequest
from taas_magic.kernel.pragma import PragmaTransformer, parse_header
from taas_magic.kernel.environment import rank_environments
from taas_magic.rank.state import draw_base_seed
from taas_magic.launch.rendezvous import new_run_id
from taas_magic.kernel.session import Session, SessionEnded, debug_paused
from taas_magic.kernel.spec import LaunchSpec, build, resolve_start
from taas_magic.rank.worker import RankTask


@magics_class
class TaasMagics(Magics):
    """Runs a cell as a distributed PyTorch job; see `%%taas?`.

    Its defaults are configurable as IPython's are: `%config TaasMagics.device = "cpu"`, or
    `c.TaasMagics.device = "cpu"` in ipython_config.py. An option in the cell wins over them.
    """

    device = Enum(options.DEVICES, default_value=None, allow_none=True, config=True,
                  help="The default --device (None: $TAAS_DEVICE, else auto).")
    output = Enum(options.OUTPUTS, default_value="all", config=True, help="The default --output.")
    start = Enum(options.STARTS, default_value="auto", config=True, help="The default --start.")
    view = Bool(True, config=True, help="The live view of a run (a row per rank, bars in place, identical lines "
                                        "of several ranks once); False: the ranks' output as they write it.")

    def __init__(self, shell: InteractiveShell, transformer: PragmaTransformer):
        super().__init__(shell)
        self.ipython = shell  # the same as Magics.shell, never None here
        self.transformer = transformer
        self.fork_backend = ForkBackend()
        self.forkserver_backend = ForkServerBackend()
        self.cluster: Cluster | None = None  # the connected Ray cluster, once connected
        self.cluster_address = connection.address_from(os.environ)  # connected to on first use
        self.session: Session | None = None  # the ranks of `--keep`, between cells
        self.paused: tuple[Any, int, LaunchSpec] | None = None  # --debug: a one-shot run's group, its rank paused at its error, the run's spec

    @options.declare
    @no_var_expand  # done in the magic, only where there is something to expand (_expand_variables)
    @line_cell_magic
    def taas(self, line: str, cell: str | None = None) -> None:
        """Run this cell as a distributed PyTorch job: one process (rank) per GPU.

        Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
        MASTER_PORT, ...), so `torch.distributed.init_process_group("nccl", init_method="env://")`
        works unchanged and Lightning needs no init. `#!g2.8` / `#pragma taas --gpus 8` at the
        top of a cell means `%%taas --config g2.8 --gpus 8`. `%taas` alone shows the settings.

        `--keep` starts a session: the ranks stay, and the taas cells that follow run in them
        (`--ranks 0,2` in part of them); `%taas stop` ends it. `%taas debug [RANK]` opens pdb in a
        rank whose cell raised (in a session, or paused by `--debug`); `breakpoint()` works in ranks.
        """
        line = _expand_variables(self.ipython, line)
        words = line.split()
        if cell is None and words[:1] in (["cluster"], ["stop"], ["debug"]):
            {"cluster": self._cluster_command, "stop": self._stop_command, "debug": self._debug_command}[words[0]](words[1:])
            return
        args = options.parse(TaasMagics.taas, line)
        self._refuse_typed_internal_options(args)
        if cell is None:
            if args.check:
                self._check_configuration(args.check)
            else:
                print(self._settings())
            return
        self._let_paused_go()
        if self.session is not None and self.session.check():
            ended, self.session = self.session.ended, None
            raise SessionEnded(f"the session ended: {ended}", [
                f"taas: the session ended: {ended}. This cell did not run: run it again to run it as a one-shot "
                "cell, or start another session with --keep"])
        if self.session is not None and not args.keep:
            self._run_in_session(args, line, cell)
            return
        if args.keep and self.session is not None:
            raise TaasUsageError(f"a session is running ({self.session.size} ranks): %taas stop first, "
                                 "or leave out --keep to run the cell in it")
        if args.ranks is not None:
            raise TaasUsageError(f"--ranks {','.join(map(str, args.ranks))} runs a cell in part of a session, "
                                 "and none is running: start one with --keep")
        catalog = load_catalog()
        spec = build(self._with_defaults(args), catalog, machine.detect(), os.environ,
                     connected=self.cluster_address is not None)
        tree, code = self._compile(line, cell)
        analysed = Cell.of(tree, self.ipython.user_ns, f"Cell In[{self.ipython.execution_count}]")
        _import_torch_once()
        loaders = self._served_loaders(spec) if spec.keep else self._loaders(spec, analysed)
        if spec.keep and loaders:  # the ranks need each served loader whether this cell names it or not
            analysed = dataclasses.replace(analysed, reads=analysed.reads | {plan.name for plan in loaders})
        task = RankTask(code=code, device=spec.device, threads=spec.threads_per_rank, loaders=loaders,
                        return_names=results.wanted(analysed.binds, spec.return_names),
                        seed=draw_base_seed(), keep=spec.keep, idle_limit=spec.idle_limit, debug=spec.debug)
        backend = self._cluster_backend(spec, catalog) if spec.on_cluster else self._choose_start(spec)
        payload = backend.prepare(task, analysed)
        try:
            if spec.keep:
                outcome = self._start_session(spec, backend, payload, loaders)
            else:
                outcome = controller.run(spec, payload, backend, streams.write_to_cell, os.environ,
                                         self._cell_names(), labels=producer_labels(loaders), status=self._view_display(),
                                         keep_paused=functools.partial(self._keep_paused, spec), read_line=_read_line)
        finally:
            if isinstance(payload, ForkServerRequest):
                payload.close()  # the shipped tensors' memory file
            streams.give_back_freed_memory()
        self._take_back(outcome, spec.return_names)

    def _view_display(self) -> Any:
        """Where this cell's live view is shown (None when the view is off)."""
        return _ViewDisplay(live=getattr(self.ipython, "kernel", None) is not None).show if self.view else None

    def _with_defaults(self, args: Any) -> Any:
        """The options the cell left out, from the configured defaults (``%config TaasMagics.device = "cpu"``,
        or ipython_config.py): an option in the cell wins, then the configuration, then $TAAS_DEVICE."""
        args.output = args.output or self.output
        args.start = args.start or self.start
        if args.device is None:
            args.device = self.device
        return args

    def _cell_names(self) -> dict[str, str]:
        known = getattr(self.ipython.compile, "_filename_map", {})  # IPython's file name -> cell number
        return {name: f"Cell In[{number}]" for name, number in known.items()}

    # -- unloading and loading again ----------------------------------------------------------
    def take_over(self, old: Any) -> None:
        """``%reload_ext``: what the unloaded magics ran goes on here (the session, a rank paused by
        --debug, the cluster, the fork server) with their ``%config`` settings, as if nothing happened.
        ``old`` may be of this class as it was before the module was reloaded."""
        for name in ("fork_backend", "forkserver_backend", "cluster", "cluster_address", "session", "paused"):
            setattr(self, name, getattr(old, name))
        self.update_config(old.config)

    def close(self, why: str) -> None:
        """End all these magics run, ``why`` (a session in one line). An ended session stays, so that the
        next taas cell says it ended instead of running as a one-shot cell."""
        if self._let_paused_go():
            print(f"taas: {why}: the paused rank is gone", file=sys.stderr)
        if self.session is not None and not self.session.check():
            self.session.stop(why)
            print(f"taas: {why}: the session ended; its {_count(self.session.size, 'rank')} "
                  f"{'are' if self.session.size != 1 else 'is'} gone", file=sys.stderr)
        self.forkserver_backend.shutdown()
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.disconnect()  # its agents and their fork servers end with it

    # -- sessions -------------------------------------------------------------------------------
    def _start_session(self, spec: LaunchSpec, backend: Backend, payload: Any,
                       loaders: tuple[LoaderPlan, ...]) -> controller.Outcome:
        """Start the ranks of a session, and the producers of ``loaders``; they run this cell first, and stay."""
        envs = rank_environments(spec, new_run_id(), 0, os.environ)
        namespace = self.ipython.user_ns
        shipped = (payload.shipment.sent, frozenset(payload.task.sources)) if isinstance(payload, ForkServerRequest) \
            else getattr(backend, "shipped", None)  # on the cluster
        if shipped is not None:
            known = {name: shipping.fingerprint(namespace[name]) for name in shipped[0] if name in namespace}
            sources = set(shipped[1])
        else:
            known = {name: shipping.fingerprint(value) for name, value in self.ipython.user_ns.items()
                     if not name.startswith("_")}  # forked: the ranks have every name as it is now
            sources = set(self._cell_names())
        group = cast(SessionGroup, backend.start(envs, payload))  # fork and fork server groups take cells
        self.session = Session(group, spec, backend.name, known, sources)
        self.session.serve(loaders, namespace)
        self.session.status = self._view_display()
        session = self.session
        return self._session_outcome(lambda: session.first_cell(spec, streams.write_to_cell, self._cell_names(),
                                                                _read_line))

    def _run_in_session(self, args: Any, line: str, cell: str) -> None:
        session = self.session
        assert session is not None
        _check_fits_session(args, session)
        ranks = list(args.ranks) if args.ranks is not None else list(range(session.size))
        outside = [rank for rank in ranks if rank >= session.size]
        if outside:
            raise TaasUsageError(f"--ranks {','.join(map(str, args.ranks))}: the session has ranks 0-{session.size - 1}")
        spec = dataclasses.replace(session.spec, output=args.output or self.output, timeout=args.timeout,
                                   return_names=args.return_names)
        tree, code = self._compile(line, cell)
        analysed = Cell.of(tree, self.ipython.user_ns, f"Cell In[{self.ipython.execution_count}]")
        new = self._session_loaders(analysed, session, ranks)
        session.resend([plan.name for plan in new])  # the ranks and the producers' supervisor need the loader
        wanted = results.wanted(analysed.binds, spec.return_names) if 0 in ranks else ()
        prepared, shipment, sent = session.prepare(analysed, code, wanted)
        prepared = session.begin_serving(prepared, new, self.ipython.user_ns)
        session.status = self._view_display()  # this cell's view
        try:
            outcome = self._session_outcome(lambda: session.run(
                prepared, shipment, ranks, spec, streams.write_to_cell, self._cell_names(), _read_line))
            session.shipped(sent)
        finally:
            if shipment is not None:
                shipment.close()
            streams.give_back_freed_memory()
        self._take_back(outcome, spec.return_names)

    def _session_outcome(self, run: Any) -> controller.Outcome:
        """Run a session's cell; a session that ended is forgotten, and rank 0's names are its own."""
        session = self.session
        assert session is not None
        try:
            outcome: controller.Outcome = run()
        except SessionEnded:
            self.session = None
            raise
        return outcome

    def _served_loaders(self, spec: LaunchSpec) -> tuple[LoaderPlan, ...]:
        """Every registered loader the notebook names when a session starts: its producers start with
        the session and serve whichever of its cells iterate the loader."""
        names = delivery_planning.registered_names(self.ipython.user_ns)
        if spec.data_options_given and not names:
            print("taas: --cpus/--units/--order/--prefetch have no effect: the notebook has no registered "
                  "DataLoader (taas.register(loader) before the cell that starts the session)", file=sys.stderr)
        return delivery_planning.plans(spec, names, self.ipython.user_ns)

    def _session_loaders(self, cell: Cell, session: Session, ranks: list[int]) -> tuple[LoaderPlan, ...]:
        """Plans for the registered loaders the cell uses that the session does not serve yet (registered
        since it started): the cell starts their producers. Served loaders go to every rank: a cell in
        part of the session may not use one."""
        if session.spec.cpus == 0:
            return ()  # delivery is off: each rank iterates every loader itself
        namespace = self.ipython.user_ns
        names = delivery_planning.loaders_used(cell.reads, namespace)
        if names and len(ranks) < session.size:
            raise TaasUsageError(f"--ranks {','.join(map(str, ranks))}: the cell uses {names[0]!r}, which producers "
                                 "serve to every rank of the session: run it in every rank (leave out --ranks)")
        new = [name for name in names if not session.serves(name, namespace[name])]
        if new and session.start == "cluster":
            raise TaasUsageError(f"registered loader {new[0]!r} was registered after the session started, and on a "
                                 "cluster a session's producers start with it: %taas stop, then start the session "
                                 "again with --keep to have it served")
        return delivery_planning.plans(session.spec, new, namespace)

    def _stop_command(self, words: list[str]) -> None:
        """`%taas stop`: end the session (and let a rank paused by --debug go)."""
        if words:
            raise TaasUsageError(f"%taas stop takes nothing more; got {' '.join(words)!r}")
        stopped = self._let_paused_go()
        if self.session is not None:
            ended = self.session.check()
            size = self.session.size
            self.session.stop()
            self.session = None
            print(f"taas: the session had already ended ({ended})" if ended else
                  f"taas: session stopped; its {size} rank{'s' * (size != 1)} are gone")
        elif stopped:
            print("taas: the paused rank is gone")
        else:
            print("taas: no session is running")

    def _debug_command(self, words: list[str]) -> None:
        """`%taas debug [RANK]`: the debugger in a rank whose cell raised, at its error."""
        if len(words) > 1 or (words and not re.fullmatch(r"[0-9]{1,9}", words[0])):  # isdigit() takes "²"
            raise TaasUsageError(f"%taas debug takes a rank number, or nothing; got {' '.join(words)[:40]!r}")
        wanted = int(words[0]) if words else None
        if self.paused is not None:
            group, rank, spec = self.paused
            self.paused = None
            if wanted is not None and wanted != rank:
                group.close()
                raise TaasUsageError(f"rank {wanted} did not fail: rank {rank} was paused at its error")
            debug_paused(group, rank, spec, streams.write_to_cell, _read_line)
            return
        session = self.session
        if session is None or session.ended or not session.failed:
            raise TaasUsageError("nothing to debug: no rank's cell failed in a session, and no rank is paused "
                                 "(--debug in a one-shot cell keeps the first rank that fails)")
        rank = session.failed[0] if wanted is None else wanted  # the first to fail: the one the cell named
        if rank not in session.failed:
            raise TaasUsageError(f"rank {rank}'s last cell did not fail: debug one of ranks "
                                 f"{', '.join(map(str, sorted(session.failed)))}")
        self._session_outcome(lambda: session.debug(rank, streams.write_to_cell, _read_line))

    def _keep_paused(self, spec: LaunchSpec, group: Any, rank: int) -> None:
        self.paused = (group, rank, spec)
        print(f"taas: rank {rank} is paused at its error: %taas debug opens the debugger there "
              "(the next taas cell, or %taas stop, lets it go)", file=sys.stderr)

    def _let_paused_go(self) -> bool:
        if self.paused is None:
            return False
        group, _, _ = self.paused
        self.paused = None
        group.close()
        return True

    def _loaders(self, spec: LaunchSpec, cell: Cell) -> tuple[LoaderPlan, ...]:
        """Delivery plans for the registered loaders the cell uses; one line if the options serve none."""
        names = delivery_planning.loaders_used(cell.reads, self.ipython.user_ns)
        if spec.data_options_given and not names:
            print("taas: --cpus/--units/--order/--prefetch have no effect: the cell uses no registered DataLoader "
                  "(taas.register(loader) in an earlier cell)", file=sys.stderr)
        return delivery_planning.plans(spec, names, self.ipython.user_ns)

    def _compile(self, line: str, cell: str) -> tuple[ast.Module, CodeType]:
        """Compile the cell in the kernel, so a syntax error is reported before any rank starts.

        Line 1 stands for the `%%taas` line, so line numbers in tracebacks are the cell's own; the
        lines tracebacks quote show the cell's own header.
        """
        with self.transformer.disabled():
            source = self.ipython.transform_cell(f"# %%taas {line}\n{cell}")
        filename = self.ipython.compile.cache(source, self.ipython.execution_count)
        _show_header_as_written(filename, source, cell, self._raw_cell())
        tree = self.ipython.transform_ast(ast.parse(source, filename))
        return tree, compile(tree, filename, "exec", dont_inherit=True)

    def _refuse_typed_internal_options(self, args: Any) -> None:
        """``--check`` and ``--alone`` are what a lone ``#!NAME`` line becomes; typed by hand, in a
        ``#pragma taas`` line or a ``%%taas`` call, they are unknown options like any other."""
        if not (args.check or args.alone):
            return
        header = parse_header(self._raw_cell().splitlines(keepends=True), lambda name: True)
        if header is None or header.options is not None:
            allowed = ", ".join(options.visible_options(TaasMagics.taas))
            raise TaasUsageError(f"unknown option {'--check' if args.check else '--alone'!r}: allowed are {allowed}")

    def _raw_cell(self) -> str:
        """The cell as the user typed it: IPython stores it in the history before running it."""
        history = getattr(self.ipython.history_manager, "input_hist_raw", None) or [""]
        return str(history[-1])

    def _choose_start(self, spec: LaunchSpec) -> Backend:
        """Fork when it is safe, else the fork server."""
        can_fork = hasattr(os, "fork")
        # An initialized CUDA context makes any fork risky; a poisoned fork matters to GPU ranks only.
        unsafe = machine.cuda_initialized_in_kernel() or (
            spec.device == "cuda" and can_fork and machine.fork_poisoned_for_cuda())
        start, notice = resolve_start(spec.start, spec.device, unsafe, can_fork,
                                      grpc_threads=can_fork and machine.grpc_threads_in_kernel())
        if notice:
            print(notice, file=sys.stderr)
        return self.fork_backend if start == "fork" else self.forkserver_backend

    # -- the cluster ----------------------------------------------------------------------------
    def _connected(self) -> Cluster:
        """The cluster, connecting on first use (to the address of %taas cluster or $TAAS_CLUSTER)."""
        if self.cluster is None:
            assert self.cluster_address is not None
            self.cluster = Cluster.connect(self.cluster_address, connection.idle_seconds_from(os.environ))
        return self.cluster

    def _cluster_backend(self, spec: LaunchSpec, catalog: Catalog) -> Backend:
        producer_node = catalog.get(PRODUCER_NODE) if PRODUCER_NODE in catalog.names() else None
        return ClusterBackend(self._connected(), spec, lambda line: print(line, file=sys.stderr), producer_node)

    def _cluster_command(self, words: list[str]) -> None:
        """`%taas cluster [ADDRESS | off | release]`: connect, show the nodes, go back to this machine."""
        if len(words) > 1:
            raise TaasUsageError(f"%taas cluster takes one of ADDRESS, off, release; got {' '.join(words)!r}")
        word = words[0] if words else ""
        if word not in ("", "release"):
            self._refuse_while_on_the_cluster()
        if word == "off":
            if self.cluster is not None:
                self.cluster.disconnect()
            self.cluster, self.cluster_address = None, None
            print("taas: cells run on this machine")
        elif word == "release":
            print(self._release())
        elif word:
            if self.cluster is not None:
                self.cluster.disconnect()
            self.cluster, self.cluster_address = None, word
            try:
                connected = self._connected()
            except BaseException:
                self.cluster_address = None  # this machine, as the new cluster did not answer
                raise
            print(connected.describe(load_catalog()))
        elif self.cluster_address is None:
            print("taas: not connected to a cluster: %taas cluster ADDRESS (auto, HOST:PORT or ray://HOST:PORT)")
        else:
            print(self._connected().describe(load_catalog()))

    def _refuse_while_on_the_cluster(self) -> None:
        """Leaving the cluster ends its agents, and with them the ranks of a session or a paused rank there."""
        if self.session is not None and self.session.start == "cluster" and not self.session.check():
            raise TaasUsageError(f"a session runs on the cluster ({_count(self.session.size, 'rank')}): "
                                 "%taas stop first, then change the cluster")
        if self.paused is not None and self.paused[2].on_cluster:
            raise TaasUsageError(f"rank {self.paused[1]} is paused on the cluster (--debug): %taas debug or "
                                 "%taas stop first, then change the cluster")

    def _release(self) -> str:
        """`%taas cluster release`: end the idle agents; those serving a session or a paused rank are not idle."""
        if self.cluster is None:
            return "taas: 0 warm agents released"
        serving, what = set(), ""
        if self.session is not None and not self.session.check():
            serving, what = _nodes_of(self.session.group), "the running session (%taas stop ends it)"
        elif self.paused is not None:
            serving, what = _nodes_of(self.paused[0]), "the paused rank (%taas stop lets it go)"
        released, kept = self.cluster.release(keep=serving)
        line = f"taas: {released} warm agent{'s' * (released != 1)} released"
        return line + (f"; {kept} kept: {'they serve' if kept != 1 else 'it serves'} {what}" if kept else "")

    def _take_back(self, outcome: controller.Outcome, requested: tuple[str, ...] | None) -> None:
        """Rank 0's names join the notebook's namespace; one line lists what could not come back
        (names rank 0 never bound only if ``--return`` asked for them)."""
        skipped = results.worth_saying(outcome.skipped, requested)
        try:
            values, lost = results.loads(outcome.results)
        except Exception as e:  # the stream itself is damaged: no name can be read
            values, lost = {}, {"(all)": f"could not be unpickled in the kernel: {type(e).__name__}: {e}"}
        self.ipython.user_ns.update(values)  # each name that could be unpickled, whatever became of the others
        if self.session is not None:
            self.session.took_back(values)
        skipped.update(lost)
        if skipped:
            listed = "; ".join(f"{name} ({why})" for name, why in skipped.items())
            print(f"taas: not copied back from rank 0: {listed}", file=sys.stderr)

    def _check_configuration(self, name: str) -> None:
        """`#!NAME` alone: the cell runs here; warn in one line if this machine lacks what NAME needs."""
        catalog = load_catalog()
        configuration = catalog.get(name)
        found = machine.detect()
        if configuration.gpus and found.cuda_devices < configuration.gpus:
            print(f"taas: {name} needs {_count(configuration.gpus, 'GPU')}, this machine has {found.cuda_devices}: "
                  "running the cell in the kernel anyway", file=sys.stderr)
        elif not configuration.gpus and found.cpus < configuration.cpus:
            print(f"taas: {name} needs {_count(configuration.cpus, 'vCPU')}, this machine has {found.cpus}: "
                  "running the cell in the kernel anyway", file=sys.stderr)

    def _settings(self) -> str:
        catalog = load_catalog()
        found = machine.detect()
        try:
            device = options.default_device()
        except TaasUsageError as e:
            device = f"invalid ({e})"
        names = ", ".join(catalog.names())
        return "\n".join([
            "start:               fork from this kernel; the fork server once CUDA was used here",
            f"fork server:         {self.forkserver_backend.describe()}",
            "session:             " + (self.session.describe() if self.session is not None
                                       else "none (--keep starts one)"),
            f"session modules:     {reloading.describe(self.ipython)}",
            "cluster:             " + (f"{self.cluster_address} (cells run there; --on local runs one here)"
                                       if self.cluster_address else "none (%taas cluster ADDRESS connects one)"),
            f"configurations:      {'; '.join(catalog.sources)}",
            f"                     {names}",
            f"CUDA devices:        {found.cuda_devices} visible" + _cuda_used_here(),
            f"CPU cores:           {found.cpus}",
            f"default --device:    {self.device} (from %config TaasMagics.device)" if self.device
            else f"default --device:    {device} (from TAAS_DEVICE)" if os.environ.get("TAAS_DEVICE")
            else f"default --device:    {device}",
            "default --gpus:      the configuration's GPUs per node, else 1",
            "default --output:    " + ("all (each line labelled with its rank)" if self.output == "all"
                                       else "rank0 (rank 0's output alone)") + _configured(self, "output"),
            "live view:           " + ("on (a row per rank; bars in their row; identical lines of several ranks once)"
                                       if self.view else "off (the ranks' output as they write it)")
            + _configured(self, "view"),
            "default --timeout:   none",
            f"default --start:     {self.start}" + _configured(self, "start"),
            "default --return:    every name the cell binds at top level (rank 0's values)",
            "default --cpus:      1 producer per registered loader the cell uses (0: no data delivery)",
        ])


class _ViewDisplay:
    """A run's live view: one display in the cell, updated in place, left as the run's summary.

    A terminal cannot redraw a display: there (``live`` False) only the summary is shown.
    """

    def __init__(self, live: bool) -> None:
        self.live = live
        self.handle: Any = None  # IPython's DisplayHandle, once shown

    def show(self, bundle: dict[str, str], final: bool) -> None:
        from IPython.display import display

        if not self.live and not final:
            return
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)


def _check_fits_session(args: Any, session: Session) -> None:
    """A cell in a session may choose only --ranks, --return, --timeout and --output; an option that
    would make it another run (its size, device, configuration, start) is an error."""
    spec = session.spec
    same = {
        "--gpus": args.gpus in (None, spec.world_size),
        "--config": args.config is None or (spec.configuration is not None and args.config == spec.configuration.name),
        "--device": args.device in (None, "auto", spec.device),
        "--start": args.start in (None, "auto", session.start, "spawn" if session.start == "forkserver" else ""),
        "--on": args.on in (None, "cluster" if session.start == "cluster" else "local"),
    }
    one_shot = {"--cpus": args.cpus is not None, "--units": args.units is not None,
                "--prefetch": args.prefetch is not None, "--order": args.order != "deterministic",
                "--max-restarts": args.max_restarts != 0, "--debug": args.debug, "--idle": args.idle is not None}
    changed = [name for name, ok in same.items() if not ok]
    if changed:
        raise TaasUsageError(f"{', '.join(changed)} would change the running session ({session.size} ranks on "
                             f"{spec.device}): %taas stop first, then start another with --keep")
    others = [name for name, given in one_shot.items() if given]
    if others:
        raise TaasUsageError(f"{', '.join(others)} cannot apply to a cell in a session: a cell there takes --ranks, "
                             "--return, --timeout and --output (%taas stop ends the session)")


def _nodes_of(group: Any) -> set[str]:
    """The ids of the cluster nodes a run's group holds (none for a group on this machine)."""
    return {node.node_id for node in group.placement.nodes} if isinstance(group, ClusterRanks) else set()


def _configured(magics: TaasMagics, name: str) -> str:
    """Where a default came from, when the user configured it (``%config`` or ipython_config.py).

    The configuration says so, not ``trait_has_value``: that turns true once the built-in default is read.
    """
    return f" (from %config TaasMagics.{name})" if f"TaasMagics.{name}" in magics.config else ""


def _cuda_used_here() -> str:
    """What CUDA already used in the kernel means for the next cells, as ``_choose_start`` decides.

    A CUDA context makes any fork unsafe; a lighter use (``torch.cuda.is_available()``) only
    leaves forked ranks unable to use CUDA, so CPU cells still fork.
    """
    if machine.cuda_initialized_in_kernel():
        return " (CUDA is initialized in this kernel: ranks start from the fork server)"
    if machine.fork_poisoned_for_cuda():
        return " (CUDA was used in this kernel: GPU cells start from the fork server; CPU cells still fork)"
    return ""


def _read_line(prompt: str) -> str:
    """A line typed by the user: Jupyter's stdin request in a notebook, the terminal in IPython."""
    return input(prompt)


def _count(number: int, unit: str) -> str:
    return f"{number} {unit}{'' if number == 1 else 's'}"


def _show_header_as_written(filename: str, source: str, cell: str, raw_cell: str) -> None:
    """Let tracebacks quote the user's `#!…` / `#pragma taas …` lines where the source has `# %%taas …`.

    The transformer (pragma.py) replaced them before the magic ran; the raw cell comes from the
    history, and is used only if its body is this cell's (not, say, an older cell when the
    history was not kept). Only the lines tracebacks quote change, not the code that runs.
    """
    lines = (raw_cell if raw_cell.endswith("\n") else raw_cell + "\n").splitlines(keepends=True)
    first = next((i for i, text in enumerate(lines) if text.strip()), 0)
    header = parse_header(lines[first:], lambda name: True)
    if header is None or header.options is None:
        return
    skip = first + header.line_count  # the user's blank lines and header, padding in the cell but its first
    if lines[skip:] != cell.splitlines(keepends=True)[skip - 1 :]:
        return
    shown = lines[:skip] + [line + "\n" for line in source.splitlines()][skip:]
    linecache.cache[filename] = (len(source), None, shown, filename)


def _expand_variables(shell: InteractiveShell, line: str) -> str:
    """IPython's `$name` / `{expression}` expansion of the options line, as in any magic.

    IPython does it by copying the notebook's whole namespace first: milliseconds in a notebook
    that holds tens of thousands of names, on every cell. Lines without `$` or `{` (nearly all)
    have nothing to expand.
    """
    if "$" not in line and "{" not in line:
        return line
    return str(shell.var_expand(line, depth=3))  # the names seen where the magic was called: its locals too


def _import_torch_once() -> None:
    """Ranks need torch; importing it here once lets every forked rank share it for free."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    plugins.find()  # once per kernel, and again after packages changed
