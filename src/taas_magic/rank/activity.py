"""In a rank: what its cell is doing, sampled with its vitals about once a second (``RankActivity``).

- **Collectives** come from torch's flight recorder, which every process group of the rank feeds
  (gloo and NCCL alike): a ring of its last collectives with their sequence number, operation,
  tensor shapes and whether they completed. taas sizes the ring (``TORCH_FR_BUFFER_SIZE``, unless
  the user chose) to the few dozen entries a diagnosis needs, so reading it costs little.
- **Data**: the registered loaders' stand-ins say which one the cell waits for, and since when.
- **Setup**: the main thread's frames say whether it is inside ``init_process_group``.
- **CPU time** of the whole process tells a rank that computes from one that sleeps.

Nothing here stops the cell, and nothing initializes CUDA or a process group.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from typing import Any

from taas_magic import torch_private
from taas_magic.delivery.standin import TAKEN, WAITING
from taas_magic.wire.records import Collective, RankActivity

SMALL_RING = 256  # entries: about 1 ms to read
_setup_since: float | None = None  # when the main thread was first seen in init_process_group
_last_status: dict[str, Any] | None = None  # the groups' counters at the last sample


def sample(whole: bool = False) -> RankActivity:
    """What the cell is doing now; ``whole``: every collective it is in named, however recently entered (a
    position taken with the rank's stacks, which is not one of the periodic samples)."""
    collectives, finished = _collectives(whole)
    now = time.monotonic()
    waiting = min(WAITING.items(), key=lambda item: item[1], default=None)
    times = os.times()
    setup = _setup(now)
    return RankActivity(
        now,
        times.user + times.system,
        finished,
        collectives,
        waiting[0] if waiting else "",
        now - waiting[1] if waiting else 0.0,
        sum(TAKEN.values()),
        setup,
        _store() if setup is not None else "",
    )


def _collectives(whole: bool) -> tuple[list[Collective], dict[str, int]]:
    """The collectives the rank is in (oldest first), and the last one each of its process groups finished.

    Each group's counters alone are cheap to read (about 10 µs); the ring's entries cost in proportion
    to its size (0.3 ms for 64, 40 ms for torch's default of 2000). A rank that moved since the last
    sample is read by its counters: a collective it is in is named by its number alone, which says
    enough of one not a second old, unless the ring is small (taas's size): then it is read whole, so that
    the shares of time name the collective (``kernel/view/time_shares.py``). A rank that did not move (in a
    collective that lasts, computing, stuck) is read whole, each collective it is in with its operation,
    tensors and time. A ``whole`` read is always read whole, and leaves the periodic samples' record of the
    counters as it was.
    """
    global _last_status
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return [], {}
    status = _flight_record(entries=False)
    if status is None:
        return [], {}
    groups = status["pg_status"]
    finished = {str(group): int(counters.get("last_completed_collective", -1)) for group, counters in groups.items()}
    if not whole:
        moved, _last_status = groups != _last_status, groups
        entered = [
            str(group)
            for group, counters in groups.items()
            if int(counters.get("last_enqueued_collective", -1)) > finished[str(group)]
        ]
        if moved and not (entered and _small_ring()):
            return [Collective(group, finished[group] + 1, "", [], [], 0.0) for group in entered], finished
    trace = _flight_record(entries=True) or {"entries": []}
    now = time.time_ns()
    inside = []
    for entry in trace["entries"]:
        p2p = bool(entry.get("is_p2p"))
        if entry.get("retired") or entry.get("state") == "completed":
            # the group's counter can lag its last collective's entry: a rank that then stood still
            # would be said to be one collective behind where it is
            group = str(entry["process_group"][0])
            if not p2p and group in finished:
                finished[group] = max(finished[group], int(entry["collective_seq_id"]))
            continue
        inside.append(
            Collective(
                group=str(entry["process_group"][0]),
                seq=int(entry["p2p_seq_id" if p2p else "collective_seq_id"]),
                op=str(entry["profiling_name"]).split(":", 1)[-1],
                shapes=[list(s) for s in entry["input_sizes"]],
                dtypes=[str(d) for d in entry["input_dtypes"]],
                seconds=max(0.0, (now - entry["time_created_ns"]) / 1e9),
                p2p=p2p,
            )
        )
    for group, seq in finished.items():
        # gloo finishes the collectives in order: an entry at or before the last finished one is done
        inside = [c for c in inside if c.group != group or c.p2p or c.seq > seq]
    return inside, finished  # -1: a group the rank is in that has finished none yet


def _small_ring() -> bool:
    """Whether the flight recorder's ring is small enough to read at every sample that finds the rank in a
    collective (so the shares of time name it): taas's own size, or one the user chose as small."""
    try:
        return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "2000")) <= SMALL_RING
    except ValueError:
        return False


def _flight_record(entries: bool) -> dict[str, Any] | None:
    """The flight recorder's per-group counters and (``entries``) its ring, from NCCL's ring and the
    other backends' one."""
    readers = torch_private.flight_recorder_dumps()
    if not readers:
        return None
    merged: dict[str, Any] = {"entries": [], "pg_status": {}}
    for reader in readers:
        try:
            trace = pickle.loads(reader(entries, False, False))  # no stack traces, retired entries too
        except Exception:  # no ring (size 0), or this build records nothing for the backend
            continue
        merged["entries"] += trace.get("entries", [])
        merged["pg_status"].update(trace.get("pg_status", {}))
    return merged


def _store() -> str:
    """The rendezvous address of ``init_method="env://"``, which taas's ranks use unless told otherwise."""
    address, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"{address}:{port}" if address and port else ""


def _setup(now: float) -> float | None:
    """Seconds the main thread has been in ``init_process_group``; None when it is not in it."""
    global _setup_since
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        if frame.f_code.co_name == "init_process_group" and "torch/distributed" in frame.f_code.co_filename:
            if _setup_since is None:
                _setup_since = now
            return now - _setup_since
        frame = frame.f_back
    _setup_since = None
    return None
