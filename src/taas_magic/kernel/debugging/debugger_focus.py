"""Which ranks' threads are stopped in the notebook's visual debugger, and which of them the front end shows:
decided by one thread, which takes the ranks' events in the order they came.

Each rank's engine is read on a thread of its own (``rank_engines.py``), and the front end's requests are
answered on the kernel's control loop; before, each of those threads changed these tables itself. Here every
event goes through a queue to one thread (started when one comes, gone once nothing is due), which alone
changes the tables, publishes the front end's events and, after a rank went on, shows another stopped rank.
Other threads read ``Focus.now``, a snapshot that thread replaces whole.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from taas_magic.kernel.debugging.debugger_router import Ids, Message, translate
from taas_magic.kernel.debugging.rank_engines import RankEngine
from taas_magic.process.kernel_debugger import hidden_thread

SHOW_NEXT_SECONDS = 0.5  # after a rank went on: a step stops it again within this, else another stopped rank is shown
IDLE_SECONDS = 1.0  # the thread leaves after this long with nothing to do; the next event starts it again
EVENTS = ("stopped", "continued", "thread")  # what a front end needs of a rank's events (not its modules, output)


@dataclass(frozen=True)
class Now:
    """The focus as other threads read it: the front end's id of the thread it shows (that of the last
    ``stopped`` event sent), and the front end's ids of the stopped rank threads, by rank number."""

    shown: int | None = None
    stopped: dict[int, frozenset[int]] = field(default_factory=dict)

    def stopped_ranks(self) -> frozenset[int]:
        return frozenset(rank for rank, threads in self.stopped.items() if threads)

    def stopped_threads(self) -> list[int]:
        return [thread for threads in self.stopped.values() for thread in threads]


class Focus:
    """``ids``: the front end's ids for the ranks' own, by kind; ``publish(kind, body)`` sends a debug event."""

    def __init__(
        self,
        ids: dict[str, Ids[RankEngine]],
        publish: Callable[[str, Message], None],
        show_next_seconds: float = SHOW_NEXT_SECONDS,
    ):
        self.ids = ids
        self.publish = publish
        self.show_next_seconds = show_next_seconds
        self.now = Now()
        # Changed on the focus thread only:
        self._stopped: dict[RankEngine, dict[int, Message]] = {}  # each rank's stopped threads (its own ids)
        self._shown: int | None = None
        self._stops_shown = 0  # ``stopped`` events sent so far
        self._show_next: tuple[float, RankEngine, int] | None = None  # (when, the rank that went on, stops by then)
        # Shared, under the lock:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # work was put, or taken
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        self._running = False
        self._busy = False

    # -- from any thread ---------------------------------------------------------------------------
    def rank_event(self, rank: RankEngine, event: Message) -> None:
        """An event a rank's engine sent (on its reader thread)."""
        if event.get("event") in EVENTS:
            self._put(lambda: self._event(rank, event))

    def rank_gone(self, rank: RankEngine) -> None:
        """The rank's connection ended: its stopped threads go on, its threads exit, its ids are forgotten."""
        self._put(lambda: self._gone(rank))

    def rank_dropped(self, rank: RankEngine) -> None:
        """The client detached and the rank was let go: it is no longer stopped here; nothing is told."""
        self._put(lambda: self._drop(rank))

    def settle(self, timeout: float = 5.0) -> bool:
        """Wait until every event put so far has been taken; False if that took longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def serving(self) -> bool:
        """Whether the focus thread runs now (it leaves once idle for ``IDLE_SECONDS``)."""
        with self._lock:
            return self._running

    def forget_the_next_show(self) -> None:
        """No rank is to be shown after the last one went on (the client detached): the thread may leave."""
        with self._lock:
            self._show_next = None
            self._changed.notify_all()

    def _put(self, work: Callable[[], None]) -> None:
        with self._lock:
            self._queue.append(work)
            if not self._running:
                self._running = True
                hidden_thread(self._serve, name="taas-debugger-focus")
            self._changed.notify_all()

    # -- on the focus thread -----------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._lock:
                self._busy = False
                self._changed.notify_all()
                work = self._next()
                if work is None:
                    self._running = False
                    return
                self._busy = True
            work()

    def _next(self) -> Callable[[], None] | None:
        """(Under the lock) the next thing to do: a queued event, or the show-next look once due; None once
        nothing was due for ``IDLE_SECONDS``."""
        idle_until = time.monotonic() + IDLE_SECONDS
        while True:
            if self._queue:
                return self._queue.popleft()
            now = time.monotonic()
            if self._show_next is not None and now >= self._show_next[0]:
                _, going, stops = self._show_next
                self._show_next = None
                return lambda: self._show_a_stopped_rank(going, stops)
            if self._show_next is None and now >= idle_until:
                return None
            self._changed.wait((self._show_next[0] if self._show_next is not None else idle_until) - now)

    def _event(self, rank: RankEngine, event: Message) -> None:
        kind, body = event.get("event"), dict(event.get("body") or {})
        if kind == "stopped":
            self._stopped.setdefault(rank, {})[body["threadId"]] = body
            self._publish("stopped", self._outward(rank, {**body, "allThreadsStopped": False}))
        elif kind == "continued":
            stopped = self._stopped.get(rank, {})
            self._continued(rank, list(stopped) if body.get("allThreadsContinued") else [body["threadId"]])
        else:
            self._publish("thread", self._outward(rank, body))

    def _continued(self, rank: RankEngine, threads: list[int]) -> None:
        """The rank's threads run again. Front ends that follow one thread at a time (JupyterLab) are shown the
        rank that stopped last among those still stopped, unless something stops first (a step)."""
        stopped = self._stopped.get(rank, {})
        for thread in threads:
            stopped.pop(thread, None)
            body = {"threadId": self.ids["threads"].outward(rank, thread), "allThreadsContinued": False}
            self._publish("continued", body)
        if threads:
            self._show_next = (time.monotonic() + self.show_next_seconds, rank, self._stops_shown)

    def _show_a_stopped_rank(self, going: RankEngine, stops: int) -> None:
        """After ``going`` went on, and nothing stopped since (``stops``: the ``stopped`` events sent then), show
        the rank that stopped last of those still stopped: JupyterLab follows the last ``stopped`` event's thread."""
        if self._stopped.get(going) or self._stops_shown != stops:
            return
        waiting = [(rank, thread, body) for rank, threads in self._stopped.items() for thread, body in threads.items()]
        if waiting:
            rank, thread, body = waiting[-1]
            self._publish("stopped", self._outward(rank, {**body, "threadId": thread, "allThreadsStopped": False}))

    def _gone(self, rank: RankEngine) -> None:
        self._continued(rank, list(self._stopped.get(rank, {})))
        self._stopped.pop(rank, None)
        for thread in self.ids["threads"].of(rank):
            self._publish("thread", {"reason": "exited", "threadId": thread})
        for ids in self.ids.values():
            ids.forget(rank)
        self._snapshot()

    def _drop(self, rank: RankEngine) -> None:
        self._stopped.pop(rank, None)
        if self._show_next is not None and self._show_next[1] is rank:
            self._show_next = None
        for ids in self.ids.values():
            ids.forget(rank)
        self._snapshot()

    def _outward(self, rank: RankEngine, value: Message) -> Message:
        outward: Message = translate(value, lambda kind, number: self.ids[kind].outward(rank, number))
        return outward

    def _publish(self, kind: str, body: Message) -> None:
        if kind == "stopped":
            self._shown = body["threadId"]
            self._stops_shown += 1
        elif kind == "continued" and body["threadId"] == self._shown:
            self._shown = None
        self._snapshot()
        self.publish(kind, body)

    def _snapshot(self) -> None:
        stopped = {
            rank.number: frozenset(self.ids["threads"].outward(rank, thread) for thread in threads)
            for rank, threads in self._stopped.items()
        }
        self.now = Now(self._shown, stopped)
