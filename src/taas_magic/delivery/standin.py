"""What a rank iterates in place of a registered loader: its share of the stream, in order.

Each ``iter()`` is the next pass; ``len()`` is the rank's share of one pass, as with a
``DistributedSampler``. Elements that arrive before their turn wait in a small buffer, so
the order is the same on every run whatever the number of producers; with ``--order
fastest`` the rank takes whatever of its share is ready first. Attributes the stand-in does
not have (``dataset``, ``batch_size``…) are the original loader's.
"""

from __future__ import annotations

import collections
import itertools
import select
import socket
import time
import weakref
from typing import Any, Callable, Iterator

from taas_magic.delivery.counters import Counters
from taas_magic.delivery.plan import StreamPlan
from taas_magic.delivery.transport import discard_waiting, receive, receive_if_waiting
from taas_magic.process.containment import HeldInterrupts
from taas_magic.wire.records import DeliveryProgress, DeliverySummary

# What this rank's cell is doing with its loaders, read by its activity sampler (``rank.activity``):
WAITING: dict[str, float] = {}  # loader name -> time.monotonic() when the cell began waiting for its element
TAKEN: dict[str, int] = {}  # loader name -> elements the cell took so far


class StandIn:
    # Why it never goes back to the notebook (``results``): it is the loader's end of this run's channels.
    taas_only_in_the_job = (
        "a registered loader's stand-in, which exists only inside the job: the notebook has the loader itself"
    )

    def __init__(
        self,
        name: str,
        loader: Any,
        rank: int,
        plan: StreamPlan,
        channel: socket.socket,
        counters: Counters,
        fastest: bool,
        device: str,
        reports: bool = True,
    ):
        self._name, self._loader, self._rank, self._plan = name, loader, rank, plan
        self._channel, self._counters, self._fastest = channel, counters, fastest
        self._reports = reports  # on a cluster the kernel makes the progress line from every node's counters
        self._pin = device == "cuda" and bool(getattr(loader, "pin_memory", False))
        self._passes = plan.passes()
        self._early: dict[tuple[int, int], list[Any]] = {}
        self._position = 0  # rounds of the stream this rank is past (skipped ones included)
        self._delivered = 0
        self._summarized = (0, 0.0)  # elements taken and seconds waited up to the last summary
        self._dropped = 0  # elements received, or held, and thrown away
        self._waited = 0.0
        self._first_wait: float | None = None
        self._started: float | None = None
        self._last: float | None = None
        self._open: Any = None  # the pass being iterated
        self._closed_pass = -1  # passes up to this one are over for this rank
        self._readable = select.poll()  # not select(): a rank may hold more than 1024 descriptors
        self._readable.register(channel, select.POLLIN)
        weakref.finalize(self, _left, channel, counters, rank)

    @property
    def original(self) -> Any:
        """The notebook's loader this stand-in is served in place of."""
        return self._loader

    def __len__(self) -> int:
        return self._plan.share()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __repr__(self) -> str:
        return f"<taas stand-in for {self._name!r}: rank {self._rank}'s share of {len(self)} per pass>"

    def __iter__(self) -> Iterator[Any]:
        self._abandon()  # a pass left unfinished by an earlier iterator ends here
        pass_ = next(self._passes, None)
        if pass_ is None:
            return  # --units used up
        self._open = pass_
        self._counters.asked[self._rank] = 1
        order = self._plan.sequence(pass_, self._rank)
        wanted = collections.Counter(order)
        try:
            for index in order:
                element = self._take(pass_.number, None if self._fastest else index, wanted)
                self._position += 1
                self._delivered += 1
                self._counters.position[self._rank] = self._position
                self._counters.taken[self._rank] = self._delivered
                TAKEN[self._name] = self._delivered
                self._last = time.monotonic()
                yield self._pinned(element)
                if self._open is not pass_:
                    return  # a newer iterator took over
        finally:
            if self._open is pass_:
                self._abandon()

    def _abandon(self) -> None:
        """End the open pass: what is left of it is skipped, so producers need not wait for it or send it."""
        if self._open is None:
            return
        self._position = self._open.first_round + self._open.rounds(self._plan.world)
        self._counters.position[self._rank] = self._position
        self._closed_pass = self._open.number
        self._counters.passes_over[self._rank] = self._closed_pass + 1
        self._drop([key for key in self._early if key[0] <= self._closed_pass])
        self._open = None
        self._take_in_waiting()

    def _take_in_waiting(self) -> None:
        """Receive what already waits, without waiting: what belongs to passes this rank left is dropped now."""
        try:
            while True:
                with HeldInterrupts():  # an element taken off the socket is kept: none is lost to an interrupt
                    arrived = receive_if_waiting(self._channel)
                    if arrived is None:
                        return
                    self._keep(*arrived)
        except EOFError:
            pass  # every producer is done: nothing more will come

    def start_at(self, number: int) -> None:
        """This rank's stream begins at pass ``number``, where its counters were set to (a session resized: the
        passes before went to the ranks it had)."""
        self._passes = (pass_ for pass_ in self._passes if pass_.number >= number)
        self._closed_pass = number - 1
        self._position = int(self._counters.position[self._rank])

    def take_over(self, rebuild: Callable[[set[tuple[int, int]]], dict[tuple[int, int], Any]]) -> str:
        """In a new process in place of a rank that died: the stream goes on at the pass the other ranks go on with.

        Producers wait for this rank meanwhile (its place in the stream stands still, and they stay within a
        window of it), so what they sent it is settled: of its elements from that pass on, those a producer is
        past are in the channel, taken as they are, or went with the dead process and are built again here
        (``rebuild``, as the producers built them); the others come as usual. Says what it did, in words.
        """
        counters, rank, plan = self._counters, self._rank, self._plan
        start = max(next_pass(plan, counters, peer) for peer in range(plan.world) if peer != rank)
        upcoming = next((pass_ for pass_ in self._passes if pass_.number >= start), None)
        self._passes = itertools.chain([upcoming] if upcoming is not None else [], self._passes)
        self._closed_pass = start - 1
        self._delivered, self._dropped = int(counters.taken[rank]), int(counters.dropped[rank])
        self._take_in_waiting()  # what belongs to passes before ``start`` is dropped, the rest kept
        held = sum(len(elements) for elements in self._early.values())
        self._dropped += max(0, counters.sent_to(rank) - self._delivered - self._dropped - held)  # lost with it
        missing = {key for key in self._places_passed(start) if key not in self._early}
        built = rebuild(missing)
        for key, element in built.items():
            self._early.setdefault(key, []).append(element)
        if missing - set(built):
            raise RuntimeError(f"{self._name}: elements {sorted(missing - set(built))} could not be built again")
        if upcoming is not None:
            self._position = upcoming.first_round
        counters.dropped[rank] = self._dropped
        counters.position[rank] = self._position
        counters.passes_over[rank] = start
        counters.done[rank] = 0 if upcoming is not None else 1  # a stream at its end sends it nothing more
        if upcoming is None:
            return f"{self._name!r} has no pass left"
        again = f" ({len(built)} elements the process that died had received, built again here)" if built else ""
        return f"its share of {self._name!r} goes on at pass {upcoming.number}{again}"

    def _places_passed(self, start: int) -> Iterator[tuple[int, int]]:
        """(pass number, index) of this rank's elements from pass ``start`` on that their producer is past."""
        counters = self._counters
        furthest = max(counters.past)
        for pass_ in self._plan.passes():
            if pass_.first_element >= furthest:
                return
            if pass_.number >= start:
                for index in self._plan.sequence(pass_, self._rank):
                    element = pass_.first_element + index
                    if element < counters.past[element % counters.producers]:
                        yield pass_.number, index

    def finish(self, report: Callable[[DeliveryProgress], object] | None = None) -> None:
        """The rank's cell has ended: producers send it nothing more, and what it holds is dropped.

        ``report`` gets the loader's counters as they are now, so that the progress line ends
        on the state the cell left, not on the producers' last look at it.
        """
        self._abandon()
        self._counters.done[self._rank] = 1
        self._drop(list(self._early))
        self._dropped += discard_waiting(self._channel)
        self._counters.dropped[self._rank] = self._dropped
        if report is not None and self._reports:
            report(self._counters.stats(self._name))

    def _drop(self, keys: list[tuple[int, int]]) -> None:
        for key in keys:
            self._dropped += len(self._early.pop(key))
        self._counters.dropped[self._rank] = self._dropped

    def _take(self, pass_number: int, index: int | None, wanted: collections.Counter[int]) -> Any:
        """Element ``index`` of the pass, or (index None) any element of the rank's share that is here."""
        if self._started is None:
            self._started = time.monotonic()
        while True:
            for key in [(pass_number, index)] if index is not None else list(self._early):
                if key in self._early and key[0] == pass_number and wanted[key[1]] > 0:
                    wanted[key[1]] -= 1
                    element = self._early[key].pop()
                    if not self._early[key]:
                        del self._early[key]
                    return element
            self._receive()

    def _receive(self) -> None:
        """Wait for the next element, then take it off the socket and keep it with interrupts held.

        An interrupt (a session's cell interrupted mid-pass) lands in the wait, never between
        taking an element and keeping it: the element may be of a later pass, which the next
        cell's loop must still find.
        """
        began = time.monotonic()
        WAITING[self._name] = began
        try:
            self._readable.poll()
        finally:
            WAITING.pop(self._name, None)
        with HeldInterrupts():
            pass_number, index, element = receive(self._channel)
            self._keep(pass_number, index, element)
        waited = time.monotonic() - began
        self._waited += waited
        self._counters.waited[self._rank] = int(self._waited * 1e6)
        if self._first_wait is None:
            self._first_wait = waited

    def _keep(self, pass_number: int, index: int, element: Any) -> None:
        if pass_number > self._closed_pass:
            self._early.setdefault((pass_number, index), []).append(element)
        else:  # a late arrival of a pass this rank has left
            self._dropped += 1
            self._counters.dropped[self._rank] = self._dropped

    def _pinned(self, element: Any) -> Any:
        if not self._pin:
            return element
        from torch.utils.data._utils.pin_memory import pin_memory

        return pin_memory(element)

    def summary(self) -> DeliverySummary | None:
        """What this rank took since the last summary, or None if it asked for nothing meanwhile.

        One per cell: in a session the stand-in lives on, and each cell sums up its own loops.
        """
        if self._started is None:
            return None
        span = (self._last or 0.0) - self._started
        taken, waited = self._summarized
        summary = DeliverySummary(
            self._delivered - taken, self._waited - waited, self._first_wait or 0.0, max(span, 0.0)
        )
        self._summarized = (self._delivered, self._waited)
        self._started = self._last = self._first_wait = None
        return summary


def next_pass(plan: StreamPlan, counters: Counters, rank: int) -> int:
    """The pass ``rank`` iterates next: the one after those it left or is in (its next ``iter()`` leaves the pass
    it is in); the number of passes when the stream (cut by ``--units``) has no more."""
    following = plan.first_pass_from(counters.position[rank])
    after = following.number if following is not None else sum(1 for _ in plan.passes())
    return max(int(counters.passes_over[rank]), after)


def _left(channel: socket.socket, counters: Counters, rank: int) -> None:
    """A stand-in nobody can reach any more (a session cell, or the notebook, rebound its name): its
    producers send this rank nothing more, and what waits for it is thrown away."""
    counters.done[rank] = 1
    try:
        discard_waiting(channel)
    except OSError:
        pass  # closed already
    channel.close()
