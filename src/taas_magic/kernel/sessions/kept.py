"""What a taas cell leaves running for the cells after it, and how it ends: a session's ranks (`--keep`),
or a one-shot run's rank paused at its error (`--debug`). `%taas stop` and `%taas debug` act on them.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass
from typing import Callable

from taas_magic.errors import SessionEnded, TaasUsageError
from taas_magic.kernel.header import line_commands
from taas_magic.kernel.header.option_values import count
from taas_magic.kernel.header.spec import LaunchSpec
from taas_magic.kernel.run.run_result import SESSION
from taas_magic.kernel.running.background import BackgroundRuns
from taas_magic.kernel.running.controller import watch
from taas_magic.kernel.sessions import resizing
from taas_magic.kernel.sessions.session import Session
from taas_magic.kernel.view import streams
from taas_magic.kernel.view.front_end import CellFrontEnd, ReadLine
from taas_magic.launch.backend import SessionGroup
from taas_magic.per_rank import span
from taas_magic.process import containment
from taas_magic.wire.rank_control import SessionCell


@dataclass(frozen=True)
class Paused:
    """A one-shot ``--debug`` run whose failed rank waits at its error for ``%taas debug``."""

    group: SessionGroup
    rank: int
    spec: LaunchSpec


def read_line(prompt: str) -> str:
    """A line typed by the user: Jupyter's stdin request in a notebook, the terminal in IPython."""
    return input(prompt)


class Kept:
    """The session and the paused rank, between cells; each ends with ``%taas stop``, ``close`` or its
    own end (a session's idle limit, a rank that died)."""

    def __init__(self) -> None:
        self.session: Session | None = None  # the ranks of `--keep`, between cells; one that ended stays until
        # the next taas cell or command has said so
        self.paused: Paused | None = None
        self.ended: Session | None = None  # the session the last cell was refused for, for `%taas debug` to name
        self.background = BackgroundRuns()  # the runs of --background cells, until their names are back

    # -- a paused rank ------------------------------------------------------------------------
    def keep_paused(self, spec: LaunchSpec, group: SessionGroup, rank: int) -> None:
        self.let_paused_go()  # one paused rank at a time: the one the notebook was last told of
        self.paused = Paused(group, rank, spec)
        print(
            f"taas: rank {rank} is paused at its error: %taas debug opens the debugger there "
            "(the next taas cell, or %taas stop, lets it go)",
            file=sys.stderr,
        )

    def holds_paused(self, spec: LaunchSpec) -> bool:
        """Whether the run of ``spec`` left a rank paused at its error (its processes live on)."""
        return self.paused is not None and self.paused.spec is spec

    def let_paused_go(self) -> bool:
        """End the paused rank's run, if there is one; whether there was."""
        if self.paused is None:
            return False
        group = self.paused.group
        self.paused = None
        containment.close_whole(group.close)
        return True

    # -- the session ----------------------------------------------------------------------------
    def live_session(self, command: str = "") -> Session | None:
        """The session the next cell (or ``%taas COMMAND``) runs in. One that ended since the last cell, between
        cells or during it, is forgotten, and the cell fails saying so: run in fresh ranks, a cell meant for the
        session would silently compute with the notebook's stale values."""
        self.refuse_while_in_background(f"%taas {command}" if command else "this cell")
        if self.session is not None and self.session.check():
            ended, self.session = self.session, None
            self.ended = ended
            then = (
                f"%taas {command} needs a running session: start another with --keep"
                if command
                else "This cell did not run: run it again to run it as a one-shot cell, or start another session "
                "with --keep"
            )
            raise SessionEnded(f"the session ended: {ended.ended}", [f"taas: the session ended: {ended.ended}. {then}"])
        self.ended = None
        return self.session

    def refuse_while_in_background(self, what: str) -> None:
        """While a cell of the session runs in the background, nothing else uses the session: ``what`` (a cell, a
        command) is refused in one line saying what to do."""
        busy = self.session.running_in_background() if self.session is not None else None
        if busy is not None:
            raise TaasUsageError(
                f"{what} did not run: the session is running cell {busy.cell} in the background (run {busy.number}); "
                "%taas wait waits for it, %taas stop stops it"
            )

    def forget_ended(self) -> str:
        """Let a session that ended go without a word (a cell with ``--keep`` starts another); why it ended, or ''."""
        if self.session is None or self.session.running_in_background() or not self.session.check():
            return ""
        self.ended, self.session = self.session, None
        return self.ended.ended

    # -- %taas stop, %taas debug ----------------------------------------------------------------
    def stop_command(self, words: list[str]) -> None:
        """`%taas stop`: end the session and the runs in the background (and let a rank paused by --debug go)."""
        line_commands.nothing_more("stop", words)
        stopped = self.let_paused_go()
        runs = self.background.stop_all()
        for run in runs:
            print(f"taas: {run.state()}")
        self.background.between_cells()
        if self.session is not None:
            ended = self.session.check()
            size = self.session.size
            self.session.stop()
            self.session = None
            print(
                f"taas: the session had already ended ({ended})"
                if ended
                else f"taas: session stopped; its {size} rank{'s' * (size != 1)} are gone"
            )
        elif stopped:
            print("taas: the paused rank is gone")
        elif not runs:
            print("taas: no session is running")

    def debug_command(self, words: list[str]) -> None:
        """`%taas debug [RANK]`: the debugger in a rank whose cell raised, at its error."""
        if len(words) > 1 or (words and not re.fullmatch(r"[0-9]{1,9}", words[0])):  # isdigit() takes "²"
            raise TaasUsageError(f"%taas debug takes a rank number, or nothing; got {' '.join(words)[:40]!r}")
        wanted = int(words[0]) if words else None
        size = self.paused.spec.world_size if self.paused is not None else self.session.size if self.session else 0
        if wanted is not None and size and wanted >= size:
            where = "the paused run" if self.paused is not None else "the session"
            raise TaasUsageError(f"%taas debug {words[0]}: {where} has {span(range(size))}, not rank {wanted}")
        if self.paused is not None:
            paused, self.paused = self.paused, None
            if wanted is not None and wanted != paused.rank:
                containment.close_whole(paused.group.close)
                raise TaasUsageError(f"rank {wanted} did not fail: rank {paused.rank} was paused at its error")
            debug_paused(paused.group, paused.rank, paused.spec, streams.write_to_cell, read_line)
            return
        self.refuse_while_in_background("%taas debug")
        session = self.session
        if session is not None and session.check():
            raise TaasUsageError(_ended_with(session))
        if session is None or not session.failed:
            raise TaasUsageError(
                _ended_with(self.ended)
                if self.ended is not None
                else "nothing to debug: no rank's cell failed in a session, and no rank is paused "
                "(--debug in a one-shot cell keeps the first rank that fails)"
            )
        rank = session.failed[0] if wanted is None else wanted  # the first to fail: the one the cell named
        if rank not in session.failed:
            raise TaasUsageError(
                f"rank {rank}'s last cell did not fail: debug {span(session.failed)}"
                f"{'' if len(session.failed) == 1 else ' (one of them)'}"
            )
        session.debug(rank, streams.write_to_cell, read_line)

    def resize_command(self, words: list[str]) -> None:
        """`%taas resize N`: the session goes on with N ranks, its names kept."""
        if len(words) != 1 or not re.fullmatch(r"[0-9]{1,9}", words[0]):
            got = f"; got {' '.join(words)[:40]!r}" if words else ""
            raise TaasUsageError(f"%taas resize takes the session's new number of ranks, as in %taas resize 4{got}")
        session = self.live_session("resize")
        if session is None:
            raise TaasUsageError("%taas resize: no session is running (a taas cell with --keep starts one)")
        print(resizing.resize(session, int(words[0]), CellFrontEnd(streams.write_to_cell)))

    # -- on the cluster -------------------------------------------------------------------------
    def refuse_leaving_the_cluster(self) -> None:
        """Leaving the cluster ends its agents, and with them the ranks of a session, a paused rank or a run in
        the background there."""
        self.refuse_while_on_the_cluster_in_background("change the cluster")
        if self.session is not None and self.session.start == "cluster" and not self.session.check():
            raise TaasUsageError(
                f"a session runs on the cluster ({count(self.session.size, 'rank')}): "
                "%taas stop first, then change the cluster"
            )
        if self.paused is not None and self.paused.spec.on_cluster:
            raise TaasUsageError(
                f"rank {self.paused.rank} is paused on the cluster (--debug): %taas debug or "
                "%taas stop first, then change the cluster"
            )

    def refuse_while_on_the_cluster_in_background(self, then: str) -> None:
        """A one-shot run in the background on the cluster holds agents there: nothing ends them while it runs."""
        running = [run for run in self.background.running() if run.on_cluster]
        if running:
            raise TaasUsageError(
                f"run {running[0].number} (cell {running[0].cell}) runs on the cluster in the background: "
                f"%taas wait or %taas stop first, then {then}"
            )

    def cluster_nodes_in_use(self) -> tuple[set[str], str]:
        """The ids of the cluster nodes the session or the paused rank holds, and what holds them."""
        if self.session is not None and not self.session.check():
            return set(self.session.group.nodes()), "the running session (%taas stop ends it)"
        if self.paused is not None:
            return set(self.paused.group.nodes()), "the paused rank (%taas stop lets it go)"
        return set(), ""

    # -- the end ----------------------------------------------------------------------------------
    def close(self, why: str) -> None:
        """End the paused rank, the runs in the background and the session, ``why`` (in one line). An ended
        session stays, so that the next taas cell says it ended instead of running as a one-shot cell."""
        for run in self.background.stop_all():
            print(f"taas: {why}: {run.state()}", file=sys.stderr)
        if self.let_paused_go():
            print(f"taas: {why}: the paused rank is gone", file=sys.stderr)
        if self.session is not None and not self.session.check():
            self.session.stop(why)
            print(
                f"taas: {why}: the session ended; its {count(self.session.size, 'rank')} "
                f"{'are' if self.session.size != 1 else 'is'} gone",
                file=sys.stderr,
            )


def _ended_with(session: Session) -> str:
    """What ``%taas debug`` can say of a session that ended: the ranks whose cell failed went with it."""
    if not session.failed:
        return f"nothing to debug: the session ended ({session.ended}), and no rank's cell had failed in it"
    ranks = span(session.failed)
    return (
        f"{ranks} failed in the session's last cell, and {'its' if len(session.failed) == 1 else 'their'} "
        f"error went with the session, which ended: {session.ended}. A session's failing rank waits for "
        "%taas debug while the session goes on; to keep one whatever happens, run the cell as a one-shot cell "
        "with --debug"
    )


def debug_paused(
    group: SessionGroup, rank: int, spec: LaunchSpec, write: Callable[[str, str], object], read_line: ReadLine
) -> None:
    """``%taas debug`` after a one-shot ``--debug`` cell of ``spec``: the debugger in the rank paused at
    its error; the run is over once the user leaves it."""
    # every line of the debugger, for as long as it takes, with no watchdog: a person is at its prompt
    spec = dataclasses.replace(spec, output="all", timeout=None, hang_after=0)
    watched = watch(SESSION, spec, CellFrontEnd(write, read_line=read_line), {}, [rank])
    out, pump = watched.output, watched.pump(group)
    try:
        pump.send_whole(lambda: group.run_cell(SessionCell.post_mortem(), [rank], ()))
        pump.until_over()
    finally:
        out.finish()
        containment.close_whole(group.close)
