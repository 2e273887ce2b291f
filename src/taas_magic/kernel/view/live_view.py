"""In the kernel: the live view of a run, one row per rank, as text and as HTML.

    taas: 4 ranks on cpu · running 3.2 s
    rank 0  running  312 MB   45%|████▌     | 45/100 [00:01<00:01, 40.12it/s]
    rank 1  running  309 MB   step 45, 35.2 steps/s, loss 0.1234 · 45%|████▌     | 45/100 [00:01<00:01]
    rank 2  running  305 MB   in all_reduce #1235 (4 MB float32) 12 s
    rank 3  running  305 MB   behind: at #1234, others wait in #1235 · computing
    mnist   1,200 produced · 5,400/s · 64 ready · ranks waited 3%

A rank's row holds its state (starting, running, done, failed, stopped), its current progress
bar (what the rank redraws with carriage returns), its ``taas.progress`` step and metrics, and
what its process holds (``RankVitals``: memory, GPU memory and load), and what it is doing when that
is worth a look (``RankActivity``: a collective or a wait for data that lasts, setup, computing), a rank
that has not reached the collective the others wait in marked behind. Each registered loader has a
row for its producers; on a cluster each node has one too. When the run is over the view
becomes its summary: how long it took, and each rank's peak memory, throughput and last progress.

The model knows nothing of Jupyter: the controller feeds it, and hands ``render()`` (a MIME
bundle) to whatever shows it.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from taas_magic.kernel.diagnosis.hang import computing, describe
from taas_magic.kernel.view import time_picture, time_shares
from taas_magic.per_rank import span
from taas_magic.wire.events import Key
from taas_magic.wire.records import CellEnded, DeliveryProgress, Failed, RankActivity, RankProgress, RankVitals, Record

STATES = ("starting", "running", "done", "failed", "stopped", "replaced")  # replaced: it died, a new one took over
_COLOURS = {
    "starting": "#888",
    "running": "#1f6feb",
    "done": "#1a7f37",
    "failed": "#cf222e",
    "stopped": "#bc4c00",
    "replaced": "#9a6700",
    "paused": "#8250df",
}
_BAR_RATE = re.compile(r"([0-9.]+)\s*([A-Za-z]*)/s\b")
LASTING = 1.0  # seconds in a collective, or waiting for data, before the row says so
SHARES_AFTER = 3.0  # seconds into a run before its rows say where each rank's time went


@dataclass
class _RankRow:
    state: str = "starting"
    bar: str = ""  # the latest drawing of its progress bar
    progress: RankProgress | None = None  # its latest taas.progress
    first_progress: RankProgress | None = None
    rate: float | None = None  # steps per second, between its last two taas.progress reports
    vitals: RankVitals | None = None
    peak_gpu_memory: int = 0
    activity: RankActivity | None = None  # its latest sample
    seen: float = 0.0  # when that sample came
    computing: bool = False  # it spent CPU outside collectives and data waits since the sample before

    def doing(self, waited_in: tuple[int, float] | None) -> str:
        """What the rank does, when it lasts: "in all_reduce #1235 (4 MB float32) 12 s", "waiting for data
        3 s", "in process-group setup 5 s", "computing"; ``waited_in``: the collective others wait in, and
        since when."""
        activity = self.activity
        if activity is None or self.state != "running":
            return ""
        behind = ""
        finished = max(activity.finished.get("0", 0), 0)
        inside = [c.seq for c in activity.collectives if c.group == "0" and not c.p2p]
        # Behind only on a sample taken once the others had waited a while: an older one says nothing.
        if (
            waited_in is not None
            and self.seen >= waited_in[1] + LASTING
            and waited_in[0] not in inside
            and finished < waited_in[0]
        ):
            behind = f"behind: at #{finished}, others wait in #{waited_in[0]}"
        lasting = next((c for c in activity.collectives if c.seconds >= LASTING), None)
        if lasting is not None:
            now = f"in {describe(lasting)} {lasting.seconds:.0f} s"
        elif activity.waiting and activity.waited >= LASTING:
            now = f"waiting for data {activity.waited:.0f} s"
        elif activity.setup is not None:
            now = f"in process-group setup {activity.setup:.0f} s"
        else:
            now = "computing" if self.computing else ""
        return " · ".join(part for part in (behind, now) if part)

    def progress_text(self, live: bool) -> str:
        """The rank's own step and metrics (and, while it runs, its current steps per second), then its bar.

        The numbers come first: a bar is wide, and what a narrow cell cannot show should be the bar's end.
        """
        parts = []
        if self.progress is not None:
            words = [] if self.progress.step is None else [f"step {self.progress.step}"]
            if live and self.rate is not None:
                words.append(f"{self.rate:,.1f} steps/s")
            words += [f"{name} {value:.4g}" for name, value in self.progress.metrics.items()]
            parts.append(", ".join(words))
        if self.bar:
            parts.append(self.bar)
        return " · ".join(parts)

    def average_rate(self) -> float | None:
        first, last = self.first_progress, self.progress
        if first is None or last is None or first.step is None or last.step is None or last.at <= first.at:
            return None
        return (last.step - first.step) / (last.at - first.at)

    def throughput(self) -> str:
        """Steps per second from taas.progress, else the rate the bar itself shows."""
        rate = self.average_rate()
        if rate is not None:
            return f"{rate:,.1f} steps/s"
        found = _BAR_RATE.findall(self.bar)
        return f"{found[-1][0]} {found[-1][1] or 'it'}/s" if found else ""


@dataclass
class _LoaderRow:
    first: DeliveryProgress
    latest: DeliveryProgress

    def text(self) -> str:
        """Built, taken (per rank), skipped by ranks that stopped early, ready, waited for, finished."""
        latest = self.latest
        parts = [f"{latest.produced} produced"]
        seconds = latest.at - self.first.at
        if seconds > 0:
            parts.append(f"{(latest.produced - self.first.produced) / seconds:,.0f}/s")
        parts.append(f"{sum(latest.taken)} consumed ({', '.join(map(str, latest.taken))} per rank)")
        if sum(latest.skipped):
            parts.append(f"{sum(latest.skipped)} skipped")
        parts.append(f"{latest.buffered} ready")
        if latest.waited and seconds > 0:
            parts.append(f"ranks waited {sum(latest.waited) / len(latest.waited) / seconds:.0%}")
        finished = [rank for rank, done in enumerate(latest.done) if done]
        if finished and len(finished) < len(latest.done):
            parts.append(f"{span(finished)} finished")
        return " · ".join(parts)


class RunView:
    """The rows of one run (or one session cell), fed as its events arrive."""

    def __init__(self, title: str, ranks: Iterable[int], ranks_per_node: int = 0):
        self.title = title  # "4 ranks on cpu"
        self.ranks = {rank: _RankRow() for rank in ranks}
        self.shares = {rank: time_shares.Shares() for rank in self.ranks}  # where each rank's time went
        self.ranks_per_node = ranks_per_node  # > 0 on a cluster: a row per node too
        self.loaders: dict[str, _LoaderRow] = {}
        self.changed = True  # since it was last shown
        self.paused: frozenset[int] = frozenset()  # ranks stopped in the notebook's visual debugger now

    def take(self, key: Key, record: Record, now: float | None = None) -> None:
        """Note a record of a rank or producer that came at ``now`` (None: when the record says it was
        taken); the rows compare samples by when they came."""
        self.changed |= self._take(key, record, record_time(record) if now is None else now)

    def _take(self, key: Key, record: Record, now: float) -> bool:
        """Note the record; True if the view changed."""
        if isinstance(record, DeliveryProgress):
            return self._take_delivery(record)
        if not isinstance(key, int) or key not in self.ranks:
            return False
        row = self.ranks[key]
        if isinstance(record, RankActivity):
            before = row.activity
            row.computing = before is not None and computing(before, record)
            row.activity, row.seen = record, now
            self.shares[key].add(record)
        elif isinstance(record, RankVitals):
            row.vitals = record
            row.peak_gpu_memory = max(row.peak_gpu_memory, record.gpu_memory or 0)
        elif isinstance(record, RankProgress):
            if (
                row.progress is not None
                and row.progress.step is not None
                and record.step is not None
                and record.at > row.progress.at
            ):
                row.rate = (record.step - row.progress.step) / (record.at - row.progress.at)
            row.first_progress = row.first_progress or record
            row.progress = record
        elif isinstance(record, CellEnded):
            row.state = "done"
            return True
        elif isinstance(record, Failed):  # one whose peer went away is stopped by that: the summary settles it
            row.state = "stopped" if record.interrupted or record.peer_lost else "failed"
            return True
        else:
            return False
        if row.state == "starting":
            row.state = "running"
        return True

    def bar(self, key: Key, text: str) -> None:
        row = self.ranks.get(key) if isinstance(key, int) else None
        if row is not None:
            row.bar = text
            self.changed = True
            if row.state == "starting":
                row.state = "running"

    def ended(self, key: Key, state: str) -> None:
        """A rank's process is gone: ``state`` unless its record said how its cell ended."""
        row = self.ranks.get(key) if isinstance(key, int) else None
        if row is not None and row.state in ("starting", "running"):
            row.state = state
            self.changed = True

    def settle(self, states: Mapping[Key, str]) -> None:
        """The rows' states as the run's result judged them, whichever event came first: a rank that failed
        on its own is failed, one broken by that failure stopped."""
        for key, state in states.items():
            row = self.ranks.get(key) if isinstance(key, int) else None
            if row is not None and row.state != state:
                row.state = state
                self.changed = True

    def _take_delivery(self, record: DeliveryProgress) -> bool:
        row = self.loaders.get(record.loader)
        if row is None:
            self.loaders[record.loader] = _LoaderRow(record, record)
        elif record.at >= row.latest.at:  # producers' and ranks' reports may cross
            row.latest = record
        else:
            return False
        return True

    def in_debugger(self, ranks: frozenset[int]) -> None:
        """The ranks stopped in the notebook's visual debugger now: their rows say ``paused``."""
        if ranks != self.paused:
            self.paused, self.changed = ranks, True

    # -- what is shown ------------------------------------------------------------------------
    def render(self, elapsed: float) -> dict[str, str]:
        """The view while the run goes: a MIME bundle (text and HTML)."""
        caption = f"taas: {self.title} · running {elapsed:.1f} s"
        waited_in = self._waited_in()
        shares = self._shares(elapsed)
        rows = [
            (
                f"rank {rank}",
                self._shown_state(rank, row),
                _memory(row),
                " · ".join(
                    part
                    for part in (row.doing(waited_in), row.progress_text(live=True), _shares_text(shares, rank))
                    if part
                ),
                str(rank),
            )
            for rank, row in self.ranks.items()
        ]
        return self._bundle("running", caption, rows, self._extra_rows(), _waited_notes(shares))

    def _shown_state(self, rank: int, row: _RankRow) -> str:
        return "paused" if row.state == "running" and rank in self.paused else row.state

    def _waited_in(self) -> tuple[int, float] | None:
        """The latest collective of the default group some rank has waited in for a while, and since when
        the first of them has."""
        lasting = [
            (c.seq, row.seen - c.seconds)
            for row in self.ranks.values()
            if row.activity is not None and row.state == "running"
            for c in row.activity.collectives
            if c.group == "0" and not c.p2p and c.seconds >= LASTING
        ]
        if not lasting:
            return None
        latest = max(seq for seq, _ in lasting)
        return latest, min(since for seq, since in lasting if seq == latest)

    def summary(self, outcome: str, elapsed: float) -> dict[str, str]:
        """The view once the run is over: ``outcome`` ("done", "failed", …) and per rank its peaks and throughput."""
        caption = f"taas: {self.title} · {outcome} {'in' if outcome == 'done' else 'after'} {elapsed:.1f} s"
        rows = [
            (
                f"rank {rank}",
                _over(row.state),
                _peak_memory(row),
                " · ".join(part for part in (row.throughput(), row.progress_text(live=False)) if part),
                str(rank),
            )
            for rank, row in self.ranks.items()
        ]
        return self._bundle(
            "summary", caption, rows, self._extra_rows(over=True), time_shares.lines(self._shares(elapsed))
        )

    def picture(self) -> dict[str, str] | None:
        """A picture of where each rank's time went (``--profile``), once every rank has samples enough."""
        shares = time_shares.counted(self.shares)
        return time_picture.bundle(shares) if shares else None

    def _shares(self, elapsed: float) -> dict[int, time_shares.Shares]:
        """Each rank's shares of time, once the run is long enough and every rank has samples enough."""
        return time_shares.counted(self.shares) if elapsed >= SHARES_AFTER else {}

    def _extra_rows(self, over: bool = False) -> list[tuple[str, str, str, str, str]]:
        """Rows of nodes (on a cluster) and of loaders' producers; ``over``: in the summary, where nothing
        runs any more (a node's ranks say how they ended, as their own rows do)."""
        extra = []
        if self.ranks_per_node:
            nodes: dict[int, list[_RankRow]] = {}
            for rank, row in self.ranks.items():
                nodes.setdefault(rank // self.ranks_per_node, []).append(row)
            for node, rows in sorted(nodes.items()):
                states = [_over(row.state) if over else row.state for row in rows]
                counted = ", ".join(f"{states.count(state)} {state}" for state in STATES if state in states)
                memory = sum(row.vitals.memory for row in rows if row.vitals is not None)
                extra.append((f"node {node}", counted, _bytes(memory) if memory else "", "", f"node-{node}"))
        for name, loader in sorted(self.loaders.items()):
            state = "done" if all(loader.latest.done) else "stopped" if over else "running"
            extra.append((name, state, "", loader.text(), f"loader-{name}"))
        return extra

    def _bundle(
        self,
        state: str,
        caption: str,
        rows: list[tuple[str, str, str, str, str]],
        extra: list[tuple[str, str, str, str, str]],
        notes: list[str],
    ) -> dict[str, str]:
        return {
            "text/plain": "\n".join([_text(caption, rows + extra), *notes]),
            "text/html": _html(state, caption, rows, extra, notes),
        }


def _shares_text(shares: Mapping[int, time_shares.Shares], rank: int) -> str:
    return shares[rank].text() if rank in shares else ""


def _waited_notes(shares: Mapping[int, time_shares.Shares]) -> list[str]:
    waited = time_shares.waited_for(shares)
    return [waited.text()] if waited is not None else []


def record_time(record: Record) -> float:
    """When a record says it was taken (0 for one that does not)."""
    return float(getattr(record, "at", 0.0) or getattr(record, "time", 0.0))


def _over(state: str) -> str:
    """A row's state once the run is over: one that had not said how it ended was stopped with the run
    (a session that ended, the run's processes lost)."""
    return "stopped" if state in ("starting", "running") else state


def _memory(row: _RankRow) -> str:
    vitals = row.vitals
    if vitals is None:
        return ""
    text = _bytes(vitals.memory)
    if vitals.gpu_memory is not None:
        text += f" · GPU {_bytes(vitals.gpu_memory)}"
        if vitals.gpu_utilization is not None:
            text += f" {vitals.gpu_utilization}%"
    return text


def _peak_memory(row: _RankRow) -> str:
    if row.vitals is None:
        return ""
    text = f"peak {_bytes(row.vitals.peak_memory)}"
    return text + (f" · GPU {_bytes(row.peak_gpu_memory)}" if row.peak_gpu_memory else "")


def _bytes(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.3g} {unit}"
        count /= 1000  # type: ignore[assignment]
    return f"{count:.3g} TB"


def _text(caption: str, rows: list[tuple[str, str, str, str, str]]) -> str:
    widths = [max((len(row[column]) for row in rows), default=0) for column in range(3)]
    lines = [caption]
    for row in rows:
        cells = [row[column].ljust(widths[column]) for column in range(3)] + [row[3]]
        lines.append("  ".join(cell for cell in cells if cell).rstrip())
    return "\n".join(lines)


def _html(
    state: str,
    caption: str,
    rows: list[tuple[str, str, str, str, str]],
    extra: list[tuple[str, str, str, str, str]],
    notes: list[str],
) -> str:
    cell = 'style="padding:1px 10px 1px 0;text-align:left;vertical-align:top;white-space:nowrap"'
    # A row wider than the cell wraps rather than losing its end at the cell's edge.
    wraps = (
        'style="padding:1px 10px 1px 0;text-align:left;vertical-align:top;white-space:pre-wrap;overflow-wrap:anywhere"'
    )
    body = []
    for kind, group in (("taas-row", rows), ("taas-extra", extra)):
        for name, row_state, memory, progress, key in group:
            colour = _COLOURS.get(row_state, "inherit")
            attribute = f'data-rank="{key}"' if kind == "taas-row" else f'data-key="{html.escape(key)}"'
            body.append(
                f'<tr class="{kind}" {attribute} data-state="{html.escape(row_state)}">'
                f"<td {cell}>{html.escape(name)}</td>"
                f'<td {cell}><span style="color:{colour}">{html.escape(row_state)}</span></td>'
                f"<td {cell}>{html.escape(memory)}</td>"
                f"<td {wraps}>{html.escape(progress)}</td></tr>"
            )
    body += [f'<tr class="taas-note"><td colspan="4" {wraps}>{html.escape(note)}</td></tr>' for note in notes]
    return (
        f'<table class="taas-view" data-state="{state}" style="border-collapse:collapse;'
        f'font-family:var(--jp-code-font-family,monospace);font-size:12px;margin:2px 0">'
        f'<caption style="text-align:left;font-weight:bold;padding-bottom:2px">{html.escape(caption)}</caption>'
        + "".join(body)
        + "</table>"
    )
