"""A taas cell's run, from its parsed options to rank 0's names in the notebook: a one-shot run, the
first cell of a session (`--keep`), or a cell in the running session.

    options ─► LaunchSpec ─► compiled cell ─► RankTask (built once, by the backend's ``prepare``)
            ─► backend.start / session ─► controller (pump, restarts) ─► rank 0's names back

Which backend starts the ranks (fork, the fork server, the cluster) is decided here; what each needs
besides the task is its own plan, which this module never looks into.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from types import CodeType
from typing import Any, Callable

from IPython.core.interactiveshell import InteractiveShell

from taas_magic.configurations import load_catalog
from taas_magic.delivery.service import producer_labels
from taas_magic.errors import TaasUsageError
from taas_magic.kernel.cluster_link import ClusterLink
from taas_magic.kernel.debugging.visual_debugger import RankDebugging
from taas_magic.kernel.header import cell_source
from taas_magic.kernel.header.option_values import count
from taas_magic.kernel.header.pragma import PragmaTransformer
from taas_magic.kernel.header.spec import LaunchSpec, build, debug_ranks, return_from
from taas_magic.kernel.run.run_result import RunResult
from taas_magic.kernel.running import (
    background,
    controller,
    delivery_planning,
    environment,
    names_back,
    profiling,
    start_method,
)
from taas_magic.kernel.running.background import BackgroundRun
from taas_magic.kernel.sessions import session_cells
from taas_magic.kernel.sessions.kept import Kept, read_line
from taas_magic.kernel.sessions.session import Session
from taas_magic.kernel.settings import Defaults
from taas_magic.kernel.view import streams
from taas_magic.kernel.view.front_end import CellFrontEnd, ViewDisplay, picture_in_this_cell
from taas_magic.launch.backend import Backend, Cell, MakeTask, PlanT, Sources
from taas_magic.launch.fork.backend import ForkBackend
from taas_magic.launch.forkserver.client import ForkServerBackend
from taas_magic.launch.rendezvous import new_run_id
from taas_magic.process import cell_files, containment, kernel_debugger, logs, machine
from taas_magic.rank import plugins
from taas_magic.rank.state import draw_base_seed
from taas_magic.wire import results, shipping
from taas_magic.wire.task import CellOrder, DebugLink, KernelContext, LoaderPlan, RankTask, Returns


class CellRunner:
    """Runs taas cells in ``shell``: forked from it, from the fork server, or on the cluster of ``link``;
    what outlives a cell (a session, a paused rank) is ``kept``'s."""

    def __init__(
        self,
        shell: InteractiveShell,
        transformer: PragmaTransformer,
        link: ClusterLink,
        kept: Kept,
        fork_backend: ForkBackend,
        forkserver_backend: ForkServerBackend,
        debugging: RankDebugging | None = None,
    ):
        self.shell = shell
        self.debugging = debugging
        self.transformer = transformer
        self.link = link
        self.kept = kept
        self.fork_backend = fork_backend
        self.forkserver_backend = forkserver_backend

    def run(self, args: argparse.Namespace, defaults: Defaults, line: str, cell: str) -> BackgroundRun | None:
        """Run ``cell`` with the options ``args`` (``defaults`` for those it left out); with ``--background``,
        start it and return its handle."""
        if args.background:
            background.refuse(args)
        self.kept.let_paused_go()
        ended = self.kept.forget_ended() if args.keep else ""
        if ended:
            print(f"taas: the last session ended ({ended}); this cell starts another", file=sys.stderr)
        session = self.kept.live_session()
        if session is not None and not args.keep:
            return self._run_in_session(session, args, defaults, line, cell)
        if args.keep and session is not None:
            raise TaasUsageError(
                f"a session is running ({session.size} ranks): %taas stop first, "
                "or leave out --keep to run the cell in it"
            )
        if args.ranks is not None:
            raise TaasUsageError(
                f"--ranks {','.join(map(str, args.ranks))} runs a cell in part of a session, "
                "and none is running: start one with --keep"
            )
        catalog = load_catalog()
        spec = build(
            defaults.fill_in(args), catalog, machine.detect(), os.environ, connected=self.link.address is not None
        )
        compiled = cell_source.compile_cell(self.shell, self.transformer, line, cell)
        analysed = compiled.cell
        _import_torch_once()
        namespace = self.shell.user_ns
        if spec.keep:  # the ranks need each served loader whether this cell names it or not
            loaders = delivery_planning.for_session(spec, namespace)
            analysed = dataclasses.replace(analysed, reads=analysed.reads | {plan.name for plan in loaders})
        else:
            loaders = delivery_planning.for_cell(spec, analysed.reads, namespace)
        returns = Returns(results.wanted(analysed.binds, spec.return_names), frozenset(spec.return_from))
        seed = draw_base_seed()
        traces = profiling.ProfileFolder() if spec.profile else None
        order = self._order(spec, compiled.code, returns, loaders, traces)

        def make_task(*, sources: Sources, context: KernelContext | None) -> RankTask:
            return RankTask(
                order,
                device=spec.device,
                threads=spec.threads_per_rank,
                sources=sources,
                context=context,
                seed=seed,
                keep=spec.keep,
                idle_limit=spec.idle_limit,
                debug=spec.debug,
                track=spec.hang_after > 0,
            )

        if spec.on_cluster:
            backend: Backend[Any] = self.link.backend(spec, catalog)
        elif args.background:  # the kernel is not forked while other cells run in it
            backend = self.forkserver_backend
        elif start_method.choose(spec, len(self.kept.background.running())) == "fork":
            backend = self.fork_backend
        else:
            backend = self.forkserver_backend
        return self._launch(
            backend, spec, make_task, analysed, loaders, defaults.view, traces, args.background, order.debugging
        )

    def _launch(
        self,
        backend: Backend[PlanT],
        spec: LaunchSpec,
        make_task: MakeTask,
        cell: Cell,
        loaders: tuple[LoaderPlan, ...],
        view: bool,
        traces: profiling.ProfileFolder | None,
        background: bool,
        debugged: DebugLink | None,
    ) -> BackgroundRun | None:
        """Prepare ``backend``'s plan and run it: a one-shot run, or a session's first cell; in the background,
        its handle (the names it needs are taken from the notebook now, and the environment as it is now)."""
        plan = backend.prepare(make_task, cell)
        environ = dict(os.environ)

        def work(front: CellFrontEnd) -> RunResult:
            try:
                if spec.keep:
                    return self._start_session(spec, backend, plan, loaders, front)
                paused = None if background else functools.partial(self.kept.keep_paused, spec)
                return controller.run(spec, plan, backend, front, environ, producer_labels(loaders), paused)
            finally:
                plan.close()  # what the plan held here (a memory file of shipped tensors)
                streams.give_back_freed_memory()
                if traces is not None:
                    profiling.merge_and_close(traces, spec.world_size)
                if debugged is not None and not spec.keep and not self.kept.holds_paused(spec):
                    self._debugger_told_ranks_left(debugged)

        front = self._front_end(view, spec.profile)
        if background:
            return self._background(f"{spec.world_size} ranks on {spec.device}", front, work, spec)
        self._take_back(work(front), spec.return_names, spec.return_from)
        return None

    def _background(
        self, what: str, front: CellFrontEnd, work: Callable[[CellFrontEnd], RunResult], spec: LaunchSpec
    ) -> BackgroundRun:
        """``work`` run in a thread of the kernel for this cell (``background``), with its front end: no prompt can
        be read from a cell that has ended (a rank's breakpoint() is told there is none), and the handle's stops are
        taken as interrupts. The names it sends back join the notebook between cells."""
        run = self.kept.background.new(f"In[{cell_files.running_cell_number(self.shell)}]", what, spec.on_cluster)
        front = dataclasses.replace(
            front, read_line=None, stop_asked=run.stops.take, pulls=run.pulls, errands=run.errands
        )
        run.start(lambda: work(front), lambda result: self._take_back(result, spec.return_names, spec.return_from))
        return run

    def _order(
        self,
        spec: LaunchSpec,
        code: CodeType,
        returns: Returns,
        loaders: tuple[LoaderPlan, ...],
        traces: profiling.ProfileFolder | None,
        notebook_cell: bool = True,
    ) -> CellOrder:
        """What the ranks do with this cell, from its options: made here once, whether the cell starts a run
        or goes to a session (``notebook_cell`` False: ``%taas pull`` or ``push``, which no debugger joins)."""
        return CellOrder(
            code,
            returns,
            loaders,
            debugging=self._debug_link(spec, code.co_filename) if notebook_cell else None,
            profile=traces.path if traces is not None else None,
        )

    def _debug_link(self, spec: LaunchSpec, cell_file: str) -> DebugLink | None:
        """How the cell's ranks join the notebook's visual debugger, while a client is attached to it."""
        attached = self.debugging is not None and self.debugging.attached()
        if spec.debug_ranks is not None and not attached:
            print(
                "taas: --debug-ranks has no effect: the notebook's debugger is off (switch it on first)",
                file=sys.stderr,
            )
        if self.debugging is None or not attached:
            return None
        if spec.on_cluster:
            if self.debugging.sees_breakpoints():
                print(
                    "taas: breakpoints do not stop cluster ranks: they run without the notebook's debugger "
                    "(run the cell with --on local to debug it)",
                    file=sys.stderr,
                )
            return None
        return self.debugging.link(None if spec.debug_ranks is None else frozenset(spec.debug_ranks), cell_file)

    def _debugger_told_ranks_left(self, link: DebugLink) -> None:
        """A one-shot run's processes ended: the visual debugger is told that their threads exited before the cell
        ends (its connections close as the processes end; their reader threads may not have run yet)."""
        if self.debugging is not None:
            self.debugging.ranks_left(link.run)

    def _cell_names(self) -> dict[str, str]:
        return cell_files.cell_labels(self.shell)

    def _front_end(self, view: bool, profile: bool) -> CellFrontEnd:
        """This cell's: its streams, its live view (when ``view``), the prompt a rank's debugger reads from, and
        the picture of where the time went (``profile``, shown with the view)."""
        live = getattr(self.shell, "kernel", None) is not None  # a terminal redraws nothing: the summary alone
        return CellFrontEnd(
            streams.writer_to_this_cell(),
            self._cell_names(),
            status=ViewDisplay(live).show if view else None,
            read_line=read_line,
            picture=picture_in_this_cell() if profile and view else None,
            stopped=self.debugging.stopped_ranks if self.debugging is not None else frozenset,
        )

    # -- sessions -------------------------------------------------------------------------------
    def _start_session(
        self,
        spec: LaunchSpec,
        backend: Backend[PlanT],
        plan: PlanT,
        loaders: tuple[LoaderPlan, ...],
        front: CellFrontEnd,
    ) -> RunResult:
        """Start the ranks of a session, and the producers of ``loaders``; they run this cell first, and stay."""
        launch = environment.launch(spec, new_run_id(), os.environ)
        if spec.log is not None:
            print(f"taas: TAAS_LOG={spec.log}: this session's log is {logs.run_file(launch.run_id)}", file=sys.stderr)
        namespace = self.shell.user_ns
        holding = plan.holding
        if holding is not None:
            known = {name: shipping.fingerprint(namespace[name]) for name in holding.names if name in namespace}
            sources = set(holding.sources)
        else:
            known = {
                name: shipping.fingerprint(value) for name, value in namespace.items() if not name.startswith("_")
            }  # forked: the ranks have every name as it is now
            sources = set(self._cell_names())
        group = backend.start(plan, launch)
        session = self.kept.session = Session(group, spec, backend.name, known, sources)
        session.serve(loaders, namespace)
        return session.first_cell(spec, front)

    def _run_in_session(
        self, session: Session, args: argparse.Namespace, defaults: Defaults, line: str, cell: str
    ) -> BackgroundRun | None:
        session_cells.check_fits_session(args, session)
        ranks = session_cells.session_ranks(args.ranks, session)
        compiled = cell_source.compile_cell(self.shell, self.transformer, line, cell)
        analysed = compiled.cell
        from_ranks = (
            ((0,) if 0 in ranks else ())
            if args.return_from is None
            else return_from(args.return_from, ranks, session_cells.cell_ranks(ranks, session))
        )
        spec = dataclasses.replace(
            session.spec,
            output=args.output or defaults.output,
            timeout=args.timeout,
            return_names=args.return_names,
            hang_after=args.hang_after,
            return_from=from_ranks,
            debug_ranks=debug_ranks(args.debug_ranks, range(session.size), "the session"),
            profile=bool(args.profile),
        )
        new = session_cells.new_loaders(analysed.reads, session, ranks, self.shell.user_ns)
        session.resend([plan.name for plan in new])  # the ranks and the producers' supervisor need the loader
        wanted = results.wanted(analysed.binds, spec.return_names) if from_ranks else ()
        returns = Returns(wanted, frozenset(from_ranks), session_cells.running_ranks(ranks, session))
        return self._in_session(
            session, analysed, compiled.code, ranks, spec, defaults.view, new, returns, background=args.background
        )

    def pull(
        self, session: Session, names: tuple[str, ...], from_ranks: tuple[int, ...] | None, defaults: Defaults
    ) -> None:
        """``%taas pull``: the session's values of ``names`` join the notebook, from ``from_ranks`` (every rank
        when None). Every rank takes part: a sharded value is gathered whole by all the ranks it is
        sharded over."""
        ranks = list(range(session.size))
        chosen = tuple(ranks) if from_ranks is None else return_from(from_ranks, ranks, "the session", "--ranks")
        spec = dataclasses.replace(
            session.spec,
            output=defaults.output,
            timeout=None,
            return_names=names,
            hang_after=defaults.hang_after,
            return_from=chosen,
        )
        self._in_session(
            session,
            session_cells.command_cell("pull", (), self.shell.user_ns),
            session_cells.NOTHING,
            ranks,
            spec,
            view=False,
            loaders=(),
            returns=Returns(names, frozenset(chosen)),
            notebook_cell=False,
        )

    def pull_while_running(
        self, session: Session, run: BackgroundRun, names: tuple[str, ...], from_ranks: tuple[int, ...] | None
    ) -> bool:
        """``%taas pull`` while a cell of the session runs in the background: the ranks send the names between two
        optimizer steps, every rank at the same one (at once in a cell that takes none), and go on. False when the
        cell ended before every rank answered: nothing was bound, the session is the notebook's again."""
        ranks = list(range(session.size))
        chosen = tuple(ranks) if from_ranks is None else return_from(from_ranks, ranks, "the session", "--ranks")
        request = run.pulls.ask(names, chosen)
        request.wait()
        if set(request.answers) < set(chosen):
            return False
        # The ranks hold their own (later) values of these: the next cell does not send the notebook's back.
        session.took_back(names_back.take_back_pulled(self.shell.user_ns, request.answers, names, chosen))
        return True

    def push(
        self, session: Session, names: tuple[str, ...], to_ranks: tuple[int, ...] | None, defaults: Defaults
    ) -> None:
        """``%taas push``: the notebook's values of ``names`` become the names of the session's ranks (of
        ``to_ranks``, every rank when None), whatever the ranks had bound to them."""
        missing = [name for name in names if name not in self.shell.user_ns]
        if missing:
            raise TaasUsageError(f"%taas push {missing[0]}: the notebook has no name {missing[0]!r}")
        ranks = session_cells.session_ranks(to_ranks, session)
        spec = dataclasses.replace(
            session.spec,
            output=defaults.output,
            timeout=None,
            return_names=(),
            hang_after=defaults.hang_after,
            return_from=(),
        )
        session.resend(list(names))
        self._in_session(
            session,
            session_cells.command_cell("push", names, self.shell.user_ns),
            session_cells.NOTHING,
            ranks,
            spec,
            view=False,
            loaders=(),
            returns=Returns(),
            notebook_cell=False,
        )

    def _in_session(
        self,
        session: Session,
        analysed: Cell,
        code: Any,
        ranks: list[int],
        spec: LaunchSpec,
        view: bool,
        loaders: tuple[LoaderPlan, ...],
        returns: Returns,
        notebook_cell: bool = True,
        background: bool = False,
    ) -> BackgroundRun | None:
        """Run ``code`` in the session's ``ranks``, then take back what ``returns`` asks for (``notebook_cell``
        False: ``%taas pull`` or ``push``). In the ``background``, nothing else uses the session until it ends
        (``Kept.refuse_while_in_background``); the names it needs are sent now."""
        traces = profiling.ProfileFolder() if spec.profile and notebook_cell else None
        order = self._order(spec, code, returns, loaders, traces, notebook_cell)
        prepared, shipment, sent = session.prepare(analysed, order, "" if notebook_cell else analysed.label)

        def work(front: CellFrontEnd) -> RunResult:
            try:
                result = session.run(prepared, shipment, ranks, spec, front, notebook_cell)
                session.shipped(sent)
                return result
            finally:
                if shipment is not None:
                    shipment.close()
                if traces is not None:
                    profiling.merge_and_close(traces, len(ranks))
                streams.give_back_freed_memory()

        front = self._front_end(view, traces is not None)
        if background:
            session.busy = self._background(f"{count(len(ranks), 'rank')} of the session", front, work, spec)
            return session.busy
        result = work(front)
        self._take_back(result, spec.return_names, spec.return_from, pulled=not notebook_cell)
        return None

    def _take_back(
        self, result: RunResult, requested: tuple[str, ...] | None, from_ranks: tuple[int, ...], pulled: bool = False
    ) -> dict[str, Any]:
        """The sending ranks' names join the notebook (and the session's record of what the notebook has)."""
        values = names_back.take_back(self.shell.user_ns, result, requested, from_ranks, pulled)
        if self.kept.session is not None:
            self.kept.session.took_back(values)
        return values


def _import_torch_once() -> None:
    """Ranks need torch; importing it here once lets every forked rank share it for free.

    The import is whole or not at all: an interrupt waits for its end (a second or two, the first time).
    Cut short, torch stays half-initialised in ``sys.modules``, and the next ``import torch`` crashes
    the kernel (SIGSEGV) or swallows the interrupt, so the cell runs on as if none came."""
    with containment.HeldInterrupts():
        kernel_debugger.untraced(_import_torch)
    kernel_debugger.untraced(plugins.find)  # once per kernel, and again after packages changed


def _import_torch() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
