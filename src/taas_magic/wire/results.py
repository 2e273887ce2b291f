"""Results back: the names a cell binds at top level in rank 0 come back into the notebook.

Rank 0 pickles the names one after another with one pickler, each name a pickle of its own in one
stream. The pickler remembers what it has written, so objects that share parts (a model and its
optimizer) are written once and still share them in the kernel, which loads the names in order with one
unpickler. The elements of tensors and NumPy arrays go beside the pickle (``bulk.py``): the names travel
as one ``Packed`` buffer, which the kernel maps. CUDA tensors go as CPU tensors and DDP wrappers as the
module they wrap: unpickling in the kernel must never initialize CUDA there. Sharded tensors (DTensors)
go as their full tensors, which the ranks gathered at the end of the cell (``rank/sharded.py``), and
FSDP2 or tensor-parallel modules as plain modules of their own class, without the hooks and state that
need the job's ranks (``plain_forms.py``): the notebook gets a model that runs on CPU.

Nothing is lost for one bad name. What rank 0 cannot pickle is left out by name, with the reason,
whatever the pickler raised. What the kernel cannot unpickle is left out the same way, together with the
later names that share objects with it; the other names still come back.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import types
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

from taas_magic.errors import first_line, type_name
from taas_magic.wire import beside, bulk, memfile, pickler, sparse_rebuilds
from taas_magic.wire.plain_forms import PlainForms, Whole

_HEAD = struct.Struct("!QQ")  # the lengths of the names' pickles and of the trailer after them
NOT_BOUND = "not bound when the cell ended"  # why a wanted name did not come back: said only for --return's names


class _ResultPickler(pickler.Pickler):
    """A cloudpickle pickler that sends tensors as CPU tensors, DDP wrappers as their module, DTensors as
    their full tensors and FSDP2 or tensor-parallel modules as plain modules of their own class."""

    def __init__(self, file: io.BytesIO, whole: Whole | None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.whole = whole
        self.sharded = PlainForms.find()  # None where no DTensor can exist: the common case pays nothing more
        self.beside = bulk.Collector()

    def reducer_override(self, obj: Any) -> Any:
        if self.sharded is not None:
            reduction = self.sharded.reduce(obj, self.whole)
            if reduction is not None:
                return reduction
        converted = _portable(obj)
        if converted is not obj:
            return pickler.same, (converted,)
        return self.beside.reduce(obj) or super().reducer_override(obj)


def _portable(obj: Any) -> Any:
    torch = _torch()
    if torch is None:
        return obj
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        return obj.module
    if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):  # meta: no data, pickled as it is
        return beside.on_cpu(obj)
    return obj


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")


# -- in rank 0 --------------------------------------------------------------------------------
class _Unpicklable(Exception):
    def __init__(self, name: str, why: str):
        super().__init__(name, why)
        self.name, self.why = name, why


@dataclass(frozen=True)
class Packed:
    """Names as they travel: the head (lengths, the names' pickles, the trailer with the index and where
    the memory beside them lies), then that memory, ``size`` bytes in all. It is written into a file the
    kernel maps (``write``), or made bytes to travel in a message (``to_bytes``)."""

    head: bytes
    spans: tuple[bulk.Span, ...]
    size: int
    owners: bulk.Collector  # what owns the spans' memory, kept alive until they are written

    def write(self, fd: int) -> None:
        memfile.write_bytes(fd, self.head)
        bulk.write(fd, list(self.spans))

    def to_bytes(self) -> bytes:
        buffer = bytearray(self.size)
        buffer[: len(self.head)] = self.head
        bulk.copy_into(buffer, list(self.spans))
        return bytes(buffer)


def dumps(values: dict[str, Any], whole: Whole | None = None) -> tuple[Packed, dict[str, str]]:
    """Pickle what can be pickled; returns the names packed and {name: why} for what was left out.

    ``whole``: the full values of the sharded tensors among ``values``, gathered by the ranks
    (``rank/sharded.py``); a DTensor not in it leaves its name out."""
    skipped = {name: why for name, value in values.items() if (why := _why_not_sendable(value))}
    kept = {name: value for name, value in values.items() if name not in skipped}
    try:
        return _dump_each(kept, whole), skipped
    except _Unpicklable:
        pass
    for name, value in kept.items():  # one pass finds every name that fails on its own
        try:
            _dump_each({name: value}, whole)
        except _Unpicklable as failure:
            skipped[name] = failure.why
    while True:  # what fails only beside other names (a reducer with state) is found one at a time
        kept = {name: value for name, value in kept.items() if name not in skipped}
        try:
            return _dump_each(kept, whole), skipped
        except _Unpicklable as failure:
            skipped[failure.name] = failure.why


def _dump_each(values: dict[str, Any], whole: Whole | None) -> Packed:
    """One pickle per name in one stream, then the trailer: the index ([(name, length of its pickle), ...])
    and the spans of memory that follow."""
    buffer = io.BytesIO()
    dumper = _ResultPickler(buffer, whole)
    index = []
    for name, value in values.items():
        start = buffer.tell()
        try:
            with warnings.catch_warnings():
                # A forward output of FSDP2 or DDP carries autograd's hooks, which the notebook's copy
                # never needed: torch warns that they are left out, in the rank's output.
                warnings.filterwarnings("ignore", message=r"backward hook .* will not be serialized")
                pickler.dump(dumper, value)
        except pickler.Unpicklable as e:
            raise _Unpicklable(name, f"{type_name(value)} cannot be pickled ({e.why})") from None
        index.append((name, buffer.tell() - start))
    pickles = buffer.getvalue()
    layout = dumper.beside.layout()  # from the data's start, which is aligned: each span keeps its alignment
    spans = [(s.start, s.end, s.offset) for s in layout.spans]
    trailer = pickle.dumps((index, spans, layout.compacted), protocol=pickle.HIGHEST_PROTOCOL)
    head = _HEAD.pack(len(pickles), len(trailer)) + pickles + trailer
    start = memfile.aligned(len(head))
    placed = tuple(bulk.Span(s.start, s.end, start + s.offset) for s in layout.spans)
    return Packed(head, placed, max([len(head)] + [s.offset + s.end - s.start for s in placed]), dumper.beside)


def _why_not_sendable(value: Any) -> str | None:
    """Objects that only make sense inside the job, named before pickling is even tried."""
    try:
        return _only_in_the_job(value)
    except Exception:
        return None  # an object that fails even this look: pickling will say what is wrong with it


def _only_in_the_job(value: Any) -> str | None:
    torch = _torch()
    if isinstance(value, types.ModuleType):
        return None
    said = getattr(type(value), "taas_only_in_the_job", None)  # taas's own such objects say so themselves
    if isinstance(said, str):
        return said
    if torch is not None:
        if isinstance(value, torch.utils.data.dataloader._BaseDataLoaderIter):
            return "DataLoader iterator (exists only inside the job)"
        if isinstance(value, torch.utils.data.DataLoader):
            iterator = getattr(value, "_iterator", None)
            if iterator is not None and getattr(iterator, "_workers", None):
                return "DataLoader with live worker processes"
        distributed = getattr(torch, "distributed", None)
        process_group = getattr(distributed, "ProcessGroup", None) if distributed else None
        if process_group is not None and isinstance(value, process_group):
            return "process group (exists only inside the job)"
    return None


# -- in the kernel ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Received:
    """A rank's names as they arrived, not yet unpickled: the head, and each span's memory (a flat uint8
    tensor of its own). Ray carries it from a cluster node's agent to the kernel as it is."""

    pickles: bytes
    index: list[tuple[str, int]]
    layout: bulk.Layout
    memory: list[Any]


def receive_file(fd: int, size: int) -> Received:
    """The names in the file a rank wrote (``Packed.write``): the head read, the large spans mapped."""
    pickled, trailed = _HEAD.unpack(memfile.read_bytes(fd, _HEAD.size))
    head = memfile.read_bytes(fd, pickled + trailed, _HEAD.size)
    if len(head) != pickled + trailed:
        raise EOFError("the names' file ends early")
    pickles, index, layout = _head(head, pickled)
    return Received(pickles, index, layout, [bulk.read_span(fd, span) for span in layout.spans])


def receive_bytes(data: bytes) -> Received:
    """The names in ``Packed.to_bytes``'s form (a small result, in its message)."""
    pickled, trailed = _HEAD.unpack_from(data)
    pickles, index, layout = _head(data[_HEAD.size : _HEAD.size + pickled + trailed], pickled)
    return Received(pickles, index, layout, [bulk.copy_span(data, span) for span in layout.spans])


def _head(head: bytes, pickled: int) -> tuple[bytes, list[tuple[str, int]], bulk.Layout]:
    """The names' pickles, the index and where the memory beside them lies in the file."""
    index, spans, compacted = pickle.loads(head[pickled:])
    start = memfile.aligned(_HEAD.size + len(head))
    layout = bulk.Layout([bulk.Span(low, high, start + offset) for low, high, offset in spans], compacted)
    return head[:pickled], index, layout


def loads(data: Received | bytes | None) -> tuple[dict[str, Any], dict[str, str]]:
    """Rank 0's names, and {name: why} for those that cannot be unpickled here.

    ``data``: as it arrived (``receive_file``), or ``Packed``'s bytes: tensors and arrays come back
    as views of the memory that arrived, without a copy."""
    if not data:
        return {}, {}
    received = data if isinstance(data, Received) else receive_bytes(data)
    pieces = _pieces(received.index)
    stream = io.BytesIO(received.pickles)
    reader = bulk.Reader(received.layout, received.memory)
    with sparse_rebuilds.forgotten():
        try:
            loader = beside.Unpickler(stream, reader)
            return {name: loader.load() for name, _ in pieces}, {}
        except KeyboardInterrupt:
            raise
        except BaseException:
            pass  # some name cannot be unpickled here: start again and take the names one by one
        return _load_each(stream, pieces, reader)


def _pieces(index: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """(name, where its pickle starts) for each name of the index."""
    pieces, start = [], 0
    for name, size in index:
        pieces.append((name, start))
        start += size
    return pieces


class _Lost:
    """Stands in the memo for what a name that could not be unpickled had put there."""

    def __init__(self, name: str):
        self.name = name


class _SharesLost(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _Memo(dict[int, Any]):
    """The unpickler's memo: a later name that reaches for a lost name's objects fails, naming it."""

    def __getitem__(self, index: int) -> Any:
        value = dict.__getitem__(self, index)
        if isinstance(value, _Lost):
            raise _SharesLost(value.name)
        return value


class _CarefulUnpickler(beside.Unpickling, pickle._Unpickler):
    """The pure-Python unpickler, whose memo is an attribute, reading tensors beside the pickle."""


def _load_each(
    stream: io.BytesIO, pieces: list[tuple[str, int]], reader: bulk.Reader
) -> tuple[dict[str, Any], dict[str, str]]:
    """The slow, careful way: a name that fails is left out and the others still come back.

    The Python unpickler is used here because its memo is a plain dict that can be mended: the
    entries a failed name made, or would have made, are put right, so every later name finds
    its own objects at the same places as in rank 0, and one that shares objects with the
    failed name fails too instead of getting half-built ones.
    """
    loader = _CarefulUnpickler(stream, reader)
    memo = _Memo()
    setattr(loader, "memo", memo)
    values: dict[str, Any] = {}
    lost: dict[str, str] = {}
    for name, start in pieces:
        stream.seek(start)
        before = len(memo)
        try:
            values[name] = loader.load()
            continue
        except _SharesLost as e:
            lost[name] = f"shares objects with {e.name}, which could not be unpickled in the kernel"
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            lost[name] = f"could not be unpickled in the kernel ({first_line(e)})"
        _mend(memo, before, _memo_sources(stream, start), name)
    return values, lost


_LITERALS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"})
_LOOKUPS = frozenset({"STACK_GLOBAL", "GLOBAL"})


def _memo_sources(stream: io.BytesIO, start: int) -> list[tuple[str, Any]]:
    """For each memo entry the pickle at ``start`` makes: the opcode that made the object, and its argument.

    Protocol 4 and later (the only ones rank 0 uses) memoize with MEMOIZE, right after the
    opcode that pushed the object.
    """
    stream.seek(start)
    sources, previous = [], ("", None)
    for opcode, argument, _ in pickletools.genops(stream):
        if opcode.name == "MEMOIZE":
            sources.append(previous)
        previous = (opcode.name, argument)
    return sources


def _mend(memo: _Memo, start: int, sources: list[tuple[str, Any]], name: str) -> None:
    """Put right the memo entries of the failed name ``name``.

    Strings and bytes are whole wherever the failure struck, and later names often reuse them
    (attribute and module names): they are restored. So are classes and functions found by name
    before the failure. Anything else may be half-built, or was never made: it is lost.
    """
    for index, (opcode, argument) in enumerate(sources, start):
        if opcode in _LITERALS:
            dict.__setitem__(memo, index, argument)
        elif not (opcode in _LOOKUPS and index in memo):
            dict.__setitem__(memo, index, _Lost(name))


def worth_saying(skipped: dict[str, str], requested: tuple[str, ...] | None) -> dict[str, str]:
    """The names left behind that the user should hear of.

    A name the cell binds only in other ranks' branches (``if taas.rank() == 1: t0 = …``) is
    simply not in rank 0: that is news only for a name ``--return`` asked for.
    """
    return {name: why for name, why in skipped.items() if requested is not None or why != NOT_BOUND}


def wanted(bound: Iterable[str], requested: tuple[str, ...] | None) -> tuple[str, ...]:
    """The names to send back: all bound names, or those ``--return`` asked for."""
    if requested is None:
        return tuple(name for name in bound if not name.startswith("_"))
    return requested
