"""In the kernel: a ``--profile`` run's traces, one per rank (``rank/profiling.py``), merged into one
Chrome/Perfetto trace in the notebook's folder.

Each rank's trace becomes rows of its own (``rank 3``, and ``rank 3 · GPU 0`` for its device's streams).
torch.profiler writes its times relative to a base of its process's; they are made absolute, then counted
from the run's first event, so the ranks' rows line up as they ran (the ranks share this machine's clock).
The kernel writes the one file, gzip-compressed (Perfetto and chrome://tracing open ``.json.gz`` as they
are; a trace is mostly repeated names and numbers, and comes out 5-10 times smaller): the ranks' own traces
live in a temporary folder that goes with the run. Traces pile up in the notebook's folder: the line that
names one, and `%taas`, say how much is there.
"""

from __future__ import annotations

import datetime
import glob
import gzip
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

from taas_magic.kernel.view import streams
from taas_magic.per_rank import span
from taas_magic.rank.profiling import TRACE_FILE, TRACE_NAME

ROWS_PER_RANK = 100  # process ids in the merged trace: rank r's rows are r*100, r*100+1, …


@dataclass(frozen=True)
class Written:
    """The merged trace as it was written."""

    path: str
    ranks: tuple[int, ...]
    size: int  # bytes, compressed

    def notice(self, world: int) -> str:
        missing = sorted(set(range(world)) - set(self.ranks))
        lacking = f"; rank{'s' * (len(missing) > 1)} {span(missing)} wrote none (stopped first)" if missing else ""
        count, size = kept_traces(os.path.dirname(self.path))
        kept = f"; {count} traces in this folder, {size / 1e6:.1f} MB" if count > 1 else ""
        return (
            f"taas: --profile: the ranks' trace is {self.path} ({self.size / 1e6:.1f} MB{lacking}{kept}): "
            "open it in https://ui.perfetto.dev or chrome://tracing"
        )


def kept_traces(folder: str) -> tuple[int, int]:
    """How many merged traces ``folder`` holds, and their bytes: what ``--profile`` runs left there."""
    sizes = []
    for path in glob.glob(os.path.join(glob.escape(folder), f"{PREFIX}*{SUFFIX}")):
        try:
            sizes.append(os.path.getsize(path))
        except OSError:
            continue  # removed meanwhile
    return len(sizes), sum(sizes)


class ProfileFolder:
    """Where a run's ranks write their traces: the kernel's temporary folder, removed once they are merged."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="taas-profile-")

    def merge_into(self, folder: str) -> Written | None:
        """The ranks' traces as one file in ``folder``; None when no rank wrote one."""
        traces = {}
        for path in glob.glob(os.path.join(glob.escape(self.path), TRACE_NAME.format(rank="*"))):
            found = TRACE_FILE.fullmatch(os.path.basename(path))
            if found is not None:
                try:
                    with open(path, encoding="utf-8") as file:
                        traces[int(found[1])] = json.load(file)
                except (OSError, ValueError):
                    continue  # cut short: its rank was killed while writing it
        if not traces:
            return None
        path = _new_name(folder)
        # Level 1: a 50 MB trace in 0.3 s here; the default's 10 % less takes three times as long.
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as file:
            json.dump(merge(traces), file, separators=(",", ":"))
        return Written(path, tuple(sorted(traces)), os.path.getsize(path))

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


PREFIX, SUFFIX = "taas-profile-", ".json.gz"  # a merged trace's name: taas-profile-20261128-010700.json.gz


def _new_name(folder: str) -> str:
    """``taas-profile-20261128-010700.json.gz``, with a number added when a run of the same second has it."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, number = os.path.join(folder, f"{PREFIX}{stamp}{SUFFIX}"), 1
    while os.path.exists(path):
        number += 1
        path = os.path.join(folder, f"{PREFIX}{stamp}-{number}{SUFFIX}")
    return path


def merge(traces: Mapping[int, dict[str, Any]]) -> dict[str, Any]:
    """Each rank's trace (as torch.profiler exports it) as rows of one trace: its processes renumbered
    (rank r's from ``r * ROWS_PER_RANK``) and named after it, its flows kept apart from other ranks', its
    times absolute, then counted from the earliest event of all."""
    events: list[dict[str, Any]] = []
    for rank, trace in sorted(traces.items()):
        events += _rank_events(rank, trace)
    timed = [event["ts"] for event in events if isinstance(event.get("ts"), (int, float))]
    start = min(timed, default=0.0)
    for event in events:
        if isinstance(event.get("ts"), (int, float)):
            event["ts"] = round(event["ts"] - start, 3)
    devices: list[Any] = next(
        (trace["deviceProperties"] for trace in traces.values() if trace.get("deviceProperties")), []
    )
    return {"traceEvents": events, "displayTimeUnit": "ms", "deviceProperties": devices}


def _rank_events(rank: int, trace: dict[str, Any]) -> list[dict[str, Any]]:
    base = float(trace.get("baseTimeNanoseconds", 0)) / 1000  # µs, as the events' times
    originals = trace.get("traceEvents", [])
    pids: dict[Any, int] = {_main_process(originals): rank * ROWS_PER_RANK}
    names: dict[int, str] = {}
    events = []
    for original in originals:
        event = dict(original)
        process = event.get("pid")
        if not isinstance(process, int):  # the profiler's own spans and marks ("Spans", "Traces", ""): the rank's
            process = next(iter(pids))
        pid = pids.setdefault(process, rank * ROWS_PER_RANK + len(pids))
        event["pid"] = pid
        if isinstance(event.get("ts"), (int, float)):
            event["ts"] = event["ts"] + base
        if event.get("ph") in ("s", "f", "t") and "id" in event:
            event["id"] = f"{rank}:{event['id']}"  # flows of different ranks share numbers
        if event.get("ph") == "M" and event.get("name") == "process_name":
            names[pid] = str((event.get("args") or {}).get("name", ""))
        if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index", "process_labels"):
            continue  # named and placed below, after the rank
        events.append(event)
    for pid in sorted(set(pids.values())):
        own = names.get(pid, "")
        label = f"rank {rank}" if pid == rank * ROWS_PER_RANK else f"rank {rank} · {own or 'device'}"
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    return events


def _main_process(events: list[dict[str, Any]]) -> Any:
    """The rank's own process id in its trace (its CPU operators'), as against its devices'."""
    counts = Counter(event.get("pid") for event in events if event.get("cat") == "cpu_op")
    counts = counts or Counter(event.get("pid") for event in events if event.get("pid") not in ("", None))
    return counts.most_common(1)[0][0] if counts else ""


def merge_and_close(traces: ProfileFolder, world: int) -> None:
    """A ``--profile`` run's traces, merged into one file in the notebook's folder, which the cell names."""
    try:
        written = traces.merge_into(os.getcwd())
    except OSError as e:
        streams.say(f"taas: --profile: the merged trace could not be written in {os.getcwd()}: {e}")
        return
    finally:
        traces.close()
    if written is None:
        streams.say("taas: --profile: no rank wrote its trace (each was killed before it could)")
    else:  # in a run in the background's thread, into its own cell
        streams.say(written.notice(world))
