"""A producer: a process that fetches its share of a registered loader's stream for the ranks.

Producer j of K takes the stream's elements whose number is j modulo K and builds each one
with the loader's own dataset, sampler, collate_fn and worker processes, then sends it to the
rank(s) it is for. Every producer computes the same pass orders: each seeds its random
generators with the run's seed and replays the sampler from there, pass after pass, so the
order is the same in every producer and on every run, whether forked from the kernel or from
the fork server. Each sample is drawn under a seed made of the run's seed and its place in the stream,
so random transforms give the same element whatever K is.

Producers stay at most ``window`` rounds ahead of the slowest rank, which bounds memory and
can never deadlock: the element the slowest rank waits for is always inside the window.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Collection, Generator, Iterator

from taas_magic.delivery.counters import Counters
from taas_magic.delivery.plan import Pass, StreamPlan
from taas_magic.delivery.transport import send
from taas_magic.process import child, tempfiles, tracebacks
from taas_magic.wire.records import Failed

STATS_SECONDS = 0.5
DEMAND_SECONDS = 0.01  # how often an idle session producer looks whether a rank began iterating
ElementKey = tuple[Pass, int, Any]  # (pass, element index, the sample indices it is built from)

log = logging.getLogger(__name__)


class _Stop:
    """How a producer leaves when taas stops it with SIGTERM (the ranks are done, or one failed): quietly.

    The signal becomes a KeyboardInterrupt, so the producer leaves through its ``finally``
    blocks, but not while its loader's workers start or shut down (``held``): that would leave
    them half made. One that lands in a destructor or finalizer (torch's and multiprocessing's
    run at any moment) is not printed as "Exception ignored in …": the producer leaves at its
    next ``check`` instead. The workers share the producer's process group, so they get the
    signal too: from then on their deaths are expected, and torch's SIGCHLD handler must not
    raise them as an error.
    """

    def __init__(self) -> None:
        self.asked = False
        self.holds = 0

    def install(self) -> None:
        """In the producer's own process: the kernel's handlers and hooks are not touched."""
        signal.signal(signal.SIGTERM, self._on_signal)
        shown = sys.unraisablehook

        def unless_stopping(unraisable: Any) -> None:
            if not (self.asked and isinstance(unraisable.exc_value, KeyboardInterrupt)):
                shown(unraisable)

        sys.unraisablehook = unless_stopping

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.asked = True
        # A handler that does nothing, not SIG_DFL: a SIGCHLD already pending would find no
        # Python handler, and Python prints "Signal 17 ignored due to race condition".
        signal.signal(signal.SIGCHLD, _expected)
        self.check()

    def check(self) -> None:
        """Leave now if taas asked, unless held."""
        if self.asked and not self.holds:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A stop asked meanwhile is only noted: the next ``check`` after it leaves."""
        self.holds += 1
        try:
            yield
        finally:
            self.holds -= 1


def _expected(signum: int, frame: FrameType | None) -> None:
    """A worker of a producer being stopped ended: nothing to do, the producer is leaving too."""


@dataclass
class ProducerTask:
    """Everything producer ``index`` needs; inherited by fork, never pickled."""

    name: str  # the loader's name in the notebook
    loader: Any
    plan: StreamPlan
    index: int
    count: int  # K
    window: int  # rounds ahead of the slowest rank
    channels: list[socket.socket]  # producers' end of each rank's channel
    counters: Counters
    seed: int
    reports_stats: bool  # producer 0 of each loader sends its counters for the progress line
    on_demand: bool = False  # a session's: wait until a rank first iterates the loader
    stop: _Stop = field(default_factory=_Stop, repr=False)

    def run(self, env: dict[str, str], fds: child.RankFds) -> int:
        shell = child.become_child(fds, env)
        _seed_everything(self.seed)  # not the state of the process it was forked from: that changes per run
        tempfiles.name_multiprocessing_folders()
        # Stopped by taas (once the ranks are done, or after a failure): leave through the
        # `finally` blocks, so that the DataLoader workers and their temporary folder go too.
        self.stop.install()
        child.wait_at_gate(fds)
        reports = threading.Lock()  # one line at a time on the report pipe
        if self.reports_stats:
            self._report_progress(fds, reports)
        try:
            log.info("producer of %s: starting", self.name)
            self._wait_for_demand()
            self._produce()
            log.info("producer of %s: produced its elements", self.name)
            self._wait_for_the_ranks()
            with self.stop.held():  # leaving anyway: a stop now would only garble the last report
                if self.reports_stats:  # the last counters, whenever the thread last looked
                    with reports:
                        child.report(fds.report, self.counters.stats(self.name))
        except BaseException as error:
            log.info("producer of %s: ended by %s", self.name, type(error).__name__)
            with self.stop.held():
                child.flush_all()
                with reports:
                    child.report(fds.report, self._failure(error, shell))
            return child.EXIT_FAILED
        finally:
            with self.stop.held():
                child.end_descendants()
                tempfiles.remove_multiprocessing_folders()
        return 0

    # -- producing --------------------------------------------------------------------------
    def _produce(self) -> None:
        self.pending: collections.deque[ElementKey] = collections.deque()  # keys handed to the fetcher, oldest first
        keys = self.pending
        fetched = self._fetch(keys)
        try:
            for element in fetched:
                self.stop.check()  # a stop that landed in a finalizer meanwhile
                pass_, index, _ = keys.popleft()
                destinations = self.plan.destinations(pass_, index)
                self._wait_for_window(destinations[0][1])
                # Not to a rank that left the pass or ended its cell; an element no rank takes any more
                # (built ahead for a pass nobody started) does not count as produced.
                takers = [rank for rank, _ in destinations if self.counters.wants(rank, pass_.number)]
                if takers:
                    self.counters.produced[self.index] += 1  # before a rank can count it consumed
                for rank in takers:
                    send(self.channels[rank], pass_.number, index, element)
                    self.counters.count_sent(self.index, rank)
                self.counters.past[self.index] = pass_.first_element + index + 1
        finally:
            fetched.close()  # its workers end now, on every way out, not whenever it is collected

    def wanted(self, pass_: Pass, index: int) -> bool:
        """Whether any rank element ``index`` of ``pass_`` is for still reads that pass."""
        return any(self.counters.wants(rank, pass_.number) for rank, _ in self.plan.destinations(pass_, index))

    def _fetch(self, keys: collections.deque[ElementKey]) -> Generator[Any, None, None]:
        """The loader's own machinery (collate_fn, workers…) over this producer's share of the stream."""
        loader = self.loader
        # Every rank's cell has ended: stop. Every rank an element is for has left its pass: do not even build it.
        mine = _Keys(self.my_elements, keys, loader.batch_sampler is not None, self.wanted, self.counters.all_done)
        options: dict[str, Any] = dict(
            num_workers=loader.num_workers,
            pin_memory=False,
            worker_init_fn=loader.worker_init_fn,
            timeout=loader.timeout,
            multiprocessing_context=loader.multiprocessing_context,
        )
        if loader.num_workers:
            options.update(prefetch_factor=loader.prefetch_factor, persistent_workers=True)
        fetcher = _fetcher(loader, mine, self.seed, **options)
        with self.stop.held():
            elements = iter(fetcher)  # starts the workers
        try:
            self.stop.check()
            yield from elements
        finally:
            with self.stop.held():
                _shut_down_workers(elements)

    def my_elements(self) -> Iterator[ElementKey]:
        """(pass, index, sample indices) of this producer's elements, in stream order."""
        return stream_elements(self.loader, self.plan, self.index, self.count)

    def _wait_for_demand(self) -> None:
        """A session serves every registered loader, used or not: one no cell iterates costs an idle
        process, and a dataset that fails fails the cell that iterates it, not the session's start.
        Once a rank has begun a pass, producers stay ahead within the window, as in a one-shot run."""
        while self.on_demand and not self.counters.any_asked() and not self.counters.all_done():
            self.stop.check()
            time.sleep(DEMAND_SECONDS)

    def _wait_for_window(self, round_: int) -> None:
        """Until the slowest rank is close enough. A session's producers look less often once it has not
        moved for a second: between cells they may wait for an hour."""
        pause, began = 0.0002, time.monotonic()
        while round_ >= self.counters.slowest_rank() + self.window:
            self.stop.check()
            time.sleep(pause)
            idle = self.on_demand and time.monotonic() - began > 1.0
            pause = min(pause * 2, DEMAND_SECONDS * 5 if idle else 0.005)

    def _wait_for_the_ranks(self) -> None:
        """Done with the stream: producer 0 stays while ranks still consume, so the progress line lives on."""
        while self.reports_stats and not self.counters.all_done() and not self.stop.asked:
            time.sleep(0.05)

    def _report_progress(self, fds: child.RankFds, lock: threading.Lock) -> None:
        """Send the loader's counters whenever they change, from a thread of its own.

        The producer's own loop may wait seconds for a slow element; the line must not stand
        still meanwhile while the ranks take, skip or finish.
        """

        def report_changes() -> None:
            last = None
            while True:
                if self.on_demand and not self.counters.any_asked():
                    time.sleep(STATS_SECONDS)  # a loader no cell iterated yet has no progress line
                    continue
                stats = self.counters.stats(self.name)
                state = dataclasses.replace(stats, at=0.0)
                if state != last:
                    try:
                        with lock:
                            child.report(fds.report, stats)
                    except OSError:
                        return  # nobody reads the reports any more
                    last = state
                time.sleep(STATS_SECONDS)

        threading.Thread(target=report_changes, name="taas-progress", daemon=True).start()

    def _failure(self, error: BaseException, shell: Any) -> Failed:
        where = ""
        pending = getattr(self, "pending", None)
        if pending:  # the fetcher delivers in order: the oldest element not yet delivered is the one that failed
            pass_, index, indices = pending[0]
            where = f" at element {index} of pass {pass_.number} (samples {_short(indices)})"
        interrupted = isinstance(error, KeyboardInterrupt)
        return Failed(
            time.monotonic(),
            type(error).__name__,
            str(error),
            [] if interrupted else tracebacks.format_traceback(_past_taas(error), shell),
            interrupted=interrupted,
            where=where.strip(),
        )


def _shut_down_workers(elements: Iterator[Any]) -> None:
    """End a DataLoader iterator's workers now (its ``__del__`` would, at a moment nobody chose).

    ``_shutdown_workers`` is private to torch, but it is what ``__del__`` calls, and calling it
    twice is harmless; an iterator without workers has none.
    """
    shut_down = getattr(elements, "_shutdown_workers", None)
    if shut_down is not None:
        shut_down()


def _past_taas(error: BaseException) -> BaseException:
    """The error with the producer's own frames cut off its traceback: they say nothing to the user."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None and "/taas_magic/" in tb.tb_frame.f_code.co_filename:
        tb = tb.tb_next
    return error.with_traceback(tb)


class _Keys:
    """The sampler a DataLoader of this process iterates: the stream's elements it builds, keyed. ``wanted``:
    whether to build an element; ``over``: whether to stop before the next one."""

    def __init__(
        self,
        elements: Callable[[], Iterator[ElementKey]],
        keys: collections.deque[ElementKey],
        batched: bool,
        wanted: Callable[[Pass, int], bool],
        over: Callable[[], bool],
    ):
        self.elements, self.keys, self.batched = elements, keys, batched
        self.wanted, self.over = wanted, over

    def __iter__(self) -> Iterator[Any]:
        for pass_, index, indices in self.elements():
            if self.over():
                return
            if not self.wanted(pass_, index):
                continue  # not this DataLoader's to build
            self.keys.append((pass_, index, indices))
            if self.batched:
                yield [(pass_.number, index, sample) for sample in indices]
            else:
                yield (pass_.number, index, indices)


def stream_elements(loader: Any, plan: StreamPlan, index: int, count: int) -> Iterator[ElementKey]:
    """(pass, index, sample indices) of the elements of producer ``index`` of ``count``, in stream order.

    The sampler is replayed pass after pass from the global random state of the moment the first element is
    asked for (seeded with the run's seed, the same in every producer), whatever else draws from it meanwhile.
    """
    import itertools

    import torch

    sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    state = torch.get_rng_state()
    number = 0
    for pass_ in plan.passes():
        saved = torch.get_rng_state()
        torch.set_rng_state(state)
        order = list(itertools.islice(iter(sampler), pass_.real))
        state = torch.get_rng_state()
        torch.set_rng_state(saved)
        for element, indices in enumerate(order):
            if (number + element) % count == index:
                yield pass_, element, indices
        number += pass_.real


def rebuild(loader: Any, plan: StreamPlan, seed: int, lost: Collection[tuple[int, int]]) -> dict[tuple[int, int], Any]:
    """Elements ``lost`` (pass number, index) of the stream, built again in this process as the producers built
    them: a rank in place of one that died lacks those the dead process had received. The sampler's order is
    replayed from the run's seed through a DataLoader made as a producer makes its own (its iterator draws from
    the random state before the sampler does), and each sample is drawn under its own seed (``_Seeded``); the
    loader's workers are not started for so few, and this process's random state is kept."""
    left = set(lost)
    if not left:
        return {}
    last = max(number for number, _ in left)

    def wanted(pass_: Pass, index: int) -> bool:
        if pass_.number > last:
            left.clear()  # past every pass asked for (the stream ends there)
        if (pass_.number, index) not in left:
            return False
        left.discard((pass_.number, index))
        return True

    keys: collections.deque[ElementKey] = collections.deque()
    mine = _Keys(
        lambda: stream_elements(loader, plan, 0, 1), keys, loader.batch_sampler is not None, wanted, lambda: not left
    )
    built = {}
    with _random_state_kept():
        _seed_everything(seed)
        for element in _fetcher(loader, mine, seed):
            pass_, index, _ = keys.popleft()
            built[(pass_.number, index)] = element
    return built


def _fetcher(loader: Any, keys: _Keys, seed: int, **options: Any) -> Any:
    """A DataLoader over ``keys``' elements of ``loader``'s dataset, each sample under its own seed, collated as the
    loader collates: one construction for a producer and for ``rebuild``, whose order replays a producer's only
    while their iterators draw from the random state alike."""
    from torch.utils.data import DataLoader

    dataset: Any = _Seeded(loader.dataset, seed)  # map-style: it has __getitem__, as DataLoader needs
    if keys.batched:
        return DataLoader(dataset, batch_sampler=keys, collate_fn=loader.collate_fn, **options)
    return DataLoader(dataset, batch_size=None, sampler=keys, collate_fn=loader.collate_fn, **options)


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """This process's random generators as they were, whatever the block seeds or draws."""
    import torch

    kept = torch.get_rng_state(), random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(kept[0])
        random.setstate(kept[1])
        if numpy is not None:
            numpy.random.set_state(numpy_state)


class _Seeded:
    """The loader's dataset, each sample drawn under a seed fixed by its place in the stream."""

    def __init__(self, dataset: Any, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __getitem__(self, key: tuple[int, int, int]) -> Any:
        pass_number, index, sample = key
        _seed_everything(hash((self.seed, pass_number, index, sample)) & 0x7FFF_FFFF_FFFF)
        return self.dataset[sample]

    def __len__(self) -> int:
        return len(self.dataset)


def _seed_everything(seed: int) -> None:
    """Seed what random transforms draw from: the CPU generator, `random` and numpy.

    Only the CPU generator: ``torch.manual_seed`` would also queue lazy seeding of every
    accelerator backend, recording a stack trace each time — a millisecond per sample.
    """
    import torch

    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def _short(indices: Any) -> str:
    if isinstance(indices, (list, tuple)) and len(indices) > 6:
        return f"{indices[0]}, {indices[1]}, … {indices[-1]}: {len(indices)} in all"
    return repr(indices)
