"""Shipping what a cell needs from the kernel's namespace to ranks that do not share its memory.

Only the names the cell reads are shipped; cloudpickle follows the functions it uses to the
globals they read. All of it goes in one pickle, so every shipped function shares one globals
dict in the ranks — the cell runs in that dict, and functions see the names the cell binds, as
in the kernel. Tensor data does not go through the pickle: it is copied once into an
anonymous memory file (memfd) that the ranks map copy-on-write, so N ranks cost one copy.

A name the cell needs that cannot be pickled (a lock, an open file, a generator…) fails the
cell before anything starts, naming the variable; an unneeded one is never looked at.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Collection

from taas_magic import torch_private
from taas_magic.errors import TaasUsageError
from taas_magic.wire import beside, memfile, pickler, sparse_rebuilds

ANCHOR = "__taas_globals_anchor__"


def needed_names(reads: Collection[str], namespace: dict[str, Any]) -> list[str]:
    """Names the cell reads that the kernel's namespace holds (builtins and IPython's own excluded)."""
    hidden = _ipython_names(namespace)
    return sorted(name for name in reads if name in namespace and name not in hidden)


def _ipython_names(namespace: dict[str, Any]) -> set[str]:
    return {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_ih", "_oh", "_dh", "_i", "_ii", "_iii"}


@dataclass
class Shipment:
    """One pickle for all ranks, and the memory file holding its tensors' data."""

    data: bytes
    tensors_fd: int | None  # memfd with every tensor's bytes; the receiver maps it
    tensors_size: int
    sent: frozenset[str] = frozenset()  # the notebook's names whose values went in it (also through functions)

    def close(self) -> None:
        if self.tensors_fd is not None:
            os.close(self.tensors_fd)
            self.tensors_fd = None


class _ShippingPickler(pickler.Pickler):
    """Pickles tensors as references into one memory file instead of by value.

    For a session's ranks (``held`` given), the notebook's own globals dict and the values the
    ranks hold already go as references to the ranks' namespace: functions then share the
    ranks' names, and what did not change is not sent again.
    """

    def __init__(
        self, file: io.BytesIO, namespace: dict[str, Any] | None = None, held: Callable[[str, Any], bool] | None = None
    ):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.beside = beside.FileTensors()
        self.namespace = namespace
        self.held = held  # whether the ranks hold the notebook's name, bound to this value, already
        # The notebook's values by identity; atoms (None, numbers, strings) are values, not objects
        # to follow: they are recognized by name, in the globals of the functions that read them.
        self.known = {id(value): name for name, value in (namespace or {}).items() if type(value) not in _ATOMS}
        self.sent: set[str] = set()  # the notebook's names whose values were pickled
        self.reached: set[str] = set()  # of those, the ones reached as objects, not as a function's globals

    def persistent_id(self, obj: Any) -> Any:
        if self.namespace is None:
            return None
        if isinstance(obj, _RanksOwn):
            return ("name", obj.name)
        if self.held is not None and self._is_notebook_globals(obj):
            return ("globals",)
        name = self.known.get(id(obj))
        if name is None:
            return None
        if self.held is not None and self.held(name, obj):
            return ("name", name)
        self.sent.add(name)
        self.reached.add(name)
        return None

    def _is_notebook_globals(self, obj: Any) -> bool:
        """Whether ``obj`` is the dict cloudpickle builds for the notebook's functions' globals.

        Looked up by the namespace's identity: before a notebook function is pickled there is no
        such dict, and no value (``None`` least of all) may pass for it."""
        built: dict[int, Any] = getattr(self, "globals_ref", {})
        return id(self.namespace) in built and obj is built[id(self.namespace)]

    def _dynamic_function_reduce(self, func: Any) -> Any:
        """A notebook function: the notebook's globals it reads go with it, less what the ranks hold.

        cloudpickle's own method (and its ``globals_ref``), extended where it builds a function's globals: no
        public hook reaches them. A cloudpickle that renames them fails the session tests that push a
        function reading a name the ranks hold (tests/unit/wire/test_shipping.py)."""
        reduced = super()._dynamic_function_reduce(func)  # type: ignore[misc]
        if self.namespace is None or func.__globals__ is not self.namespace:
            return reduced
        read = reduced[2][1]["__globals__"]  # a dict of its own: cloudpickle builds it for this function
        for name, value in list(read.items()):
            if self.held is not None and self.held(name, value):
                read[name] = _RanksOwn(name)
            else:
                self.sent.add(name)
        return reduced

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
            if not memfile.carries(obj):
                if obj.device.type not in ("cpu", "meta"):  # torch's pickle would unpickle it on the GPU
                    return pickler.same, (beside.on_cpu(obj),)
                return super().reducer_override(obj)
            return self.beside.reduce(obj, parameter=isinstance(obj, torch.nn.Parameter))
        return super().reducer_override(obj)


_ATOMS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))


@dataclass(frozen=True)
class _RanksOwn:
    """A notebook name a session's ranks hold already: it stands for their own value."""

    name: str


def pack(
    namespace: dict[str, Any], names: list[str], to: str = "ranks started with --start forkserver", track: bool = False
) -> Shipment:
    """Pickle ``names`` from ``namespace`` for the ranks; raises TaasUsageError naming what cannot go.

    ``track``: find every notebook name whose value went (for a session: ``Shipment.sent``).
    """
    return _pack(namespace, names, to, namespace if track else None, None)


def pack_for_session(
    namespace: dict[str, Any], names: list[str], held: Callable[[str, Any], bool], command: str = ""
) -> Shipment:
    """``names`` for a session's ranks; what they hold already (``held(name, value)``) goes as a
    reference to their own namespace (``unpack_into``), whatever refers to it. ``command``: the line
    (``%taas push``) that sends them, which errors name instead of a cell."""
    return _pack(namespace, names, "a session's ranks", namespace, held, command)


def _pack(
    namespace: dict[str, Any],
    names: list[str],
    to: str,
    tracked: dict[str, Any] | None,
    held: Callable[[str, Any], bool] | None,
    command: str = "",
) -> Shipment:
    for name in names:
        _check_shippable(name, namespace[name], to, command)
    anchor = types.FunctionType(compile("None", "<taas>", "eval"), namespace)
    buffer = io.BytesIO()
    pickler = _ShippingPickler(buffer, tracked, held)
    _dump_all(pickler, {ANCHOR: anchor, **{name: namespace[name] for name in names}}, to, command)
    if pickler.reached - set(names):
        _bind_reached(pickler, namespace, sorted(pickler.reached - set(names)))
    fd = _write_tensors(pickler.beside) if pickler.beside.tensors else None
    return Shipment(buffer.getvalue(), fd, pickler.beside.size, frozenset(pickler.sent) | set(names))


def _bind_reached(pickler: "_ShippingPickler", namespace: dict[str, Any], names: list[str]) -> None:
    """Bind in the ranks the notebook names of values that went only as parts of others (the class
    of a shipped object, a model an optimizer holds): the kernel counts them as sent, so the ranks
    must hold them under those names too. A second pickle in the same stream: every value in it
    went in the first, so it is a reference to what the ranks unpickled there."""
    pickler.dump({name: namespace[name] for name in names})


def _check_shippable(name: str, value: Any, to: str, command: str = "") -> None:
    """Pickle one name alone first, so that the one that cannot go is named."""
    try:
        pickler.dump(_ShippingPickler(io.BytesIO()), value)
    except pickler.Unpicklable as e:
        kind = f"a {type(value).__module__}.{type(value).__qualname__}"
        raise TaasUsageError(
            f"{command} {name}: {name!r} ({kind}) cannot be sent to {to} ({e.why}): push a value that can, "
            "or make it in a cell of the session"
            if command
            else f"the cell needs {name!r} ({kind}), which cannot be sent to {to} ({e.why}): create it inside the cell"
        ) from None


def _dump_all(dumper: "_ShippingPickler", names: dict[str, Any], to: str, command: str = "") -> None:
    """Every name together, each of which went alone: one that pickles only once fails here."""
    try:
        pickler.dump(dumper, names)
    except pickler.Unpicklable as e:
        raise TaasUsageError(
            f"{command}: the names cannot be sent to {to} together ({e.why}), though each can alone: push "
            "them one at a time, or make them in a cell of the session"
            if command
            else f"the names the cell needs cannot be sent to {to} together ({e.why}), though each can alone: "
            "create them inside the cell"
        ) from None


def _write_tensors(tensors: beside.FileTensors) -> int:
    """Copy every tensor's bytes into one anonymous memory file (the one extra copy)."""
    fd = memfile.new_file("taas-tensors", tensors.size)
    try:
        tensors.write(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- in the receiving process ---------------------------------------------------------------
def unpack(data: bytes, tensors_fd: int | None, tensors_size: int) -> dict[str, Any]:
    """The namespace the cell runs in: the shipped names in the globals dict their functions share.

    Runs in the fork server, which must never touch CUDA: tensors that lived on a GPU in the
    kernel arrive on the CPU, and the cell moves them (``.to(taas.device())``) as it would anyway.
    """
    reader = _reader(tensors_fd)
    shipped = _load(data, lambda stream: beside.Unpickler(stream, reader))
    namespace: dict[str, Any] = shipped.pop(ANCHOR).__globals__
    namespace.update(shipped)
    namespace["__name__"] = "__main__"
    return namespace


def _load(data: bytes, make: Callable[[io.BytesIO], pickle.Unpickler]) -> dict[str, Any]:
    """The shipped names: the first pickle's, and those ``_bind_reached`` added after it, read by
    one unpickler, whose memo the second pickle refers to."""
    stream = io.BytesIO(data)
    unpickler = make(stream)
    with sparse_rebuilds.forgotten():
        shipped: dict[str, Any] = unpickler.load()
        if stream.tell() < len(data):
            shipped = {**unpickler.load(), **shipped}
    return shipped


def _reader(tensors_fd: int | None) -> beside.FileReader:
    """What rebuilds the shipment's tensors: views of its memory file, mapped copy-on-write."""
    return beside.FileReader(None if tensors_fd is None else memfile.map_private(tensors_fd))


class _SessionUnpickler(beside.Unpickling, pickle.Unpickler):
    """Resolves a session shipment's references to the rank's own namespace."""

    def __init__(self, file: io.BytesIO, namespace: dict[str, Any], reader: beside.FileReader):
        super().__init__(file, reader)
        self.namespace = namespace

    def persistent_load(self, pid: Any) -> Any:
        if pid == ("globals",):
            return self.namespace
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "name":
            try:
                return self.namespace[pid[1]]
            except KeyError:
                raise pickle.UnpicklingError(
                    f"{pid[1]!r} was deleted in the ranks: bind it again in the notebook "
                    "(the ranks are sent what changed there)"
                ) from None
        raise pickle.UnpicklingError(f"unknown reference {pid!r}")


def unpack_into(namespace: dict[str, Any], data: bytes, tensors_fd: int | None, tensors_size: int) -> None:
    """In a session's rank: the shipped names join its namespace, and functions share it."""
    try:
        reader = _reader(tensors_fd)
        shipped = _load(data, lambda stream: _SessionUnpickler(stream, namespace, reader))
    finally:
        if tensors_fd is not None:
            os.close(tensors_fd)
    shipped.pop(ANCHOR)
    namespace.update(shipped)


def fingerprint(value: Any) -> Fingerprint:
    """What tells whether a notebook name still holds what a session's ranks were sent.

    Numbers, strings, bytes and ``None`` by value. Other objects by identity, held by a weak
    reference where they take one: an address alone would match a new object that took a freed
    one's place. Where taas can see it cheaply, contents too: a tensor's version counter (every
    in-place change moves it), a module's parameters and buffers, the items of a small list,
    dict, set or tuple. Other objects changed in place are not noticed.
    """
    if type(value) in _ATOMS:
        return Fingerprint((), (type(value), _atom_key(value)))
    try:
        return _fingerprint_of_object(value)
    except Exception:  # a value that answers or raises anything (a mock): by identity alone
        return Fingerprint((_Same(value),), ())


def _fingerprint_of_object(value: Any) -> Fingerprint:
    torch = sys.modules.get("torch")
    if torch is not None and type(value) in (torch.Tensor, torch.nn.Parameter):
        return Fingerprint((_Same(value),), (torch_private.version_counter(value),))
    if torch is not None and isinstance(value, torch.nn.Module) and type(value).__module__ != "unittest.mock":
        tensors = [*value.parameters(), *value.buffers()]
        versions = (torch_private.version_counter(t) for t in tensors)
        return Fingerprint(tuple(map(_Same, [value, *tensors])), (value.training, *versions))
    if type(value) in (list, dict, set, tuple) and len(value) <= SMALL:
        digest = _digest(value)
        if digest is not None:  # the same container with the same items: a rebound name is sent again
            contents, tensors = digest
            return Fingerprint(tuple(map(_Same, [value, *tensors])), (type(value), contents))
    return Fingerprint((_Same(value),), ())


@dataclass(eq=True)
class Fingerprint:
    """Equal when the objects are the same live objects and the data compare equal (plain data:
    types, numbers, digests; never a notebook value, whose ``__eq__`` may do anything)."""

    objects: tuple["_Same", ...]
    data: tuple[Any, ...]

    def keeps_other_than(self, value: Any) -> bool:
        """Whether this fingerprint keeps alive an object (one that takes no weak reference) that
        is not ``value``: the notebook let go of it, and the kernel should not hold it for the ranks."""
        return bool(self.objects) and self.objects[0].strong is not None and self.objects[0].strong is not value


class _Same:
    """One object by identity: equal to another ``_Same`` of the very same object, while it lives."""

    __slots__ = ("ref", "strong")

    def __init__(self, obj: Any) -> None:
        try:
            self.ref: Callable[[], Any] = weakref.ref(obj)
            self.strong: Any = None
        except TypeError:  # lists, dicts, tuples, some extension types: held (Session forgets rebound ones)
            self.strong = obj
            self.ref = self._strong

    def _strong(self) -> Any:
        return self.strong

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Same):
            return NotImplemented
        mine = self.ref()
        return mine is not None and mine is other.ref()

    __hash__ = None  # type: ignore[assignment]


def _atom_key(value: Any) -> Any:
    """An atom's value in a form that equals itself: NaN is not equal to NaN, but its hex is."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, complex):
        return (value.real.hex(), value.imag.hex())
    if isinstance(value, (str, bytes)) and len(value) > _DIGEST_FROM:
        return hashlib.blake2b(
            value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value, digest_size=16
        ).digest()
    return value


_DIGEST_FROM = 4096  # strings and bytes longer than this are compared by a digest, not kept


SMALL = 1000  # items of a container whose contents are compared from cell to cell
_DIGEST_LIMIT = 1 << 20  # bytes of a container's pickle past which it is compared by identity instead


def _digest(value: Any) -> tuple[bytes, list[Any]] | None:
    """A small container's items as a digest, and the tensors in it (compared by identity and
    version); None when they cannot be pickled or are too large to compare every cell."""
    buffer = _LimitedBuffer()
    pickler = _DigestPickler(buffer)
    try:
        pickler.dump(value)
    except Exception:
        return None
    return hashlib.blake2b(buffer.getvalue(), digest_size=16).digest(), pickler.tensors


class _LimitedBuffer(io.BytesIO):
    def write(self, data: Any) -> int:
        if self.tell() + len(data) > _DIGEST_LIMIT:
            raise ValueError("too large to compare")
        return super().write(data)


class _DigestPickler(pickle.Pickler):
    """Pickles a container's items for comparison: a tensor by its place and version, not its data."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Any] = []

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter):
            self.tensors.append(obj)
            return tuple, ((len(self.tensors), torch_private.version_counter(obj)),)
        return NotImplemented
