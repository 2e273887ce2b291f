"""Machine configurations (`g2.8`, `c1.4`, …): what one node of each offers.

The catalog ships with the package; a YAML file named by ``TAAS_CONFIG`` adds or overrides
entries field by field, so a team can describe its own machines without forking the package.
Loading is cached per (path, modification time, size): the transformer asks on many cells,
and a broken file is reported from the cache too. The file is bounded (size, nesting, no YAML
aliases, counts within what a node can have), so a bad one is a one-line error, not a hang.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

import yaml
from yaml.composer import ComposerError

from taas_magic.errors import TaasUsageError

ENV_VAR = "TAAS_CONFIG"

# Bounds on what a file may say. A catalog of hundreds of machines is far below MAX_FILE_BYTES,
# which the pure-Python YAML parser reads in about 0.3 s; the counts are far above any real node.
MAX_FILE_BYTES = 64 * 1024
MAX_DEPTH = 10  # levels of nesting; the catalog itself uses 4
MAX_GPUS = 64  # per node
MAX_CPUS = 4096  # vCPUs per node
MAX_MEMORY_GB = 1_000_000  # per node
MAX_NODES = 1024
_NAME = re.compile(r"\w[\w.-]*")  # what a `#!NAME` header and an error line can show


@dataclass(frozen=True)
class Configuration:
    """One node of a named machine type."""

    name: str
    gpus: int
    cpus: int
    memory_gb: float = 0.0
    gpu_model: str = ""

    def describe(self) -> str:
        gpus = f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}"
        if self.gpu_model:
            gpus += f" ({self.gpu_model})"
        return f"{self.name}: {gpus}, {self.cpus} vCPUs, {self.memory_gb:g} GB per node"


@dataclass(frozen=True)
class Catalog:
    """All known configurations, and the largest number of nodes a run may span."""

    configurations: Mapping[str, Configuration]
    max_nodes: int
    sources: tuple[str, ...]

    def __contains__(self, name: object) -> bool:
        return name in self.configurations

    def names(self) -> list[str]:
        return sorted(self.configurations, key=_natural_key)

    def get(self, name: str) -> Configuration:
        try:
            return self.configurations[name]
        except KeyError:
            known = ", ".join(self.names())
            raise TaasUsageError(f"unknown configuration {name!r}: known are {known}") from None


def load_catalog(environ: Mapping[str, str] | None = None) -> Catalog:
    """The shipped catalog merged with the user's file named by ``TAAS_CONFIG``, if any."""
    environ = os.environ if environ is None else environ
    user_path = environ.get(ENV_VAR, "")
    loaded = _load(user_path, _stamp(user_path) if user_path else None)
    if isinstance(loaded, TaasUsageError):
        raise loaded.with_traceback(None)  # the same error again, without the last raise's traceback
    return loaded


@lru_cache(maxsize=8)
def _load(user_path: str, stamp: tuple[int, ...] | None) -> Catalog | TaasUsageError:
    """The catalog, or why there is none: a broken file is read once, not once per cell."""
    try:
        return _read_catalog(user_path, stamp is not None)
    except TaasUsageError as e:
        return e


def _read_catalog(user_path: str, exists: bool) -> Catalog:
    shipped = resources.files(__package__).joinpath("configurations.yaml").read_text("utf-8")
    raw = _parse(shipped, "the shipped configurations.yaml")
    sources = ["configurations.yaml (shipped)"]
    if user_path:
        if not exists:
            raise TaasUsageError(f"{ENV_VAR}={user_path!r} does not name a readable file")
        raw = _merge(raw, _parse(_read_user_file(user_path), f"{ENV_VAR}={user_path!r}"))
        sources.append(user_path)
    return _build(raw, tuple(sources))


def _read_user_file(path: str) -> str:
    """The text of a regular file of at most MAX_FILE_BYTES; never more than that is read.

    Non-blocking, so that a FIFO is refused rather than waited on; a device such as /dev/zero
    is refused before a byte is read.
    """
    where = f"{ENV_VAR}={path!r}"
    try:
        with open(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise TaasUsageError(f"{where} does not name a readable file (not a regular file)")
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as e:  # no permission, a dangling link
        raise TaasUsageError(f"{where} does not name a readable file ({e.strerror or e})") from e
    if len(data) > MAX_FILE_BYTES:
        raise TaasUsageError(
            f"{where} is larger than {MAX_FILE_BYTES // 1024} KiB: a configurations file is a few lines"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaasUsageError(f"{where} does not name a readable file (not UTF-8 text: {e.reason})") from e


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases and without deep nesting.

    A few lines of ``*alias`` expand to billions of nodes ("billion laughs"), and the composer
    recurses once per level of nesting. The pure-Python loader on purpose: libyaml's crashes the
    process on deeply nested input.
    """

    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]  # PyYAML is untyped here
            raise ComposerError(None, None, "aliases (*name) are not allowed", mark)
        if self.depth >= MAX_DEPTH:
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]  # PyYAML is untyped here
            raise ComposerError(None, None, f"more than {MAX_DEPTH} levels of nesting", mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _parse(text: str, origin: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_StrictLoader) or {}
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer of more than 4300 digits
        # PyYAML's message spans several lines; a usage error is one line.
        raise TaasUsageError(f"{origin} is not valid YAML: {' '.join(str(e).split())}") from e
    configurations = data.get("configurations", {}) if isinstance(data, dict) else None
    if not isinstance(configurations, dict) or not all(
        fields is None or isinstance(fields, dict) for fields in configurations.values()
    ):
        raise TaasUsageError(f"{origin} must be a mapping with a 'configurations' mapping of name: {{field: value}}")
    return data


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = {**base, **{k: v for k, v in extra.items() if k != "configurations"}}
    configurations = {name: dict(fields) for name, fields in base["configurations"].items()}
    for name, fields in (extra.get("configurations") or {}).items():
        configurations[str(name)] = {**configurations.get(str(name), {}), **(fields or {})}
    merged["configurations"] = configurations
    return merged


def _build(raw: dict[str, Any], sources: tuple[str, ...]) -> Catalog:
    where = ", ".join(sources)
    configurations = {
        str(name): _configuration(str(name), fields or {}, where) for name, fields in raw["configurations"].items()
    }
    try:
        max_nodes = _whole(raw, "max_nodes", 4)
    except ValueError as e:
        raise TaasUsageError(f"max_nodes has a bad value ({e}) in {where}") from e
    if not 1 <= max_nodes <= MAX_NODES:
        raise TaasUsageError(f"max_nodes: {_shown(max_nodes)} in {where}: use 1-{MAX_NODES}")
    return Catalog(configurations, max_nodes=max_nodes, sources=sources)


def _configuration(name: str, fields: Mapping[str, Any], where: str) -> Configuration:
    """One entry, checked: a name a `#!NAME` header can hold, whole counts and a finite memory
    size, each within what a node can have."""
    if not _NAME.fullmatch(name):
        raise TaasUsageError(f"configuration name {_shown(name)} in {where}: use letters, digits, '.', '_' and '-'")
    try:
        gpus, cpus = _whole(fields, "gpus", 0), _whole(fields, "cpus", 1)
        memory_gb, gpu_model = _number(fields, "memory_gb", 0), _text(fields, "gpu_model", "")
    except ValueError as e:
        raise TaasUsageError(f"configuration {_shown(name)} has a bad field ({e}) in {where}") from e
    if not (0 <= gpus <= MAX_GPUS and 1 <= cpus <= MAX_CPUS and 0 <= memory_gb <= MAX_MEMORY_GB):  # nan fails too
        raise TaasUsageError(
            f"configuration {_shown(name)} has gpus: {_shown(gpus)}, cpus: {_shown(cpus)}, "
            f"memory_gb: {_shown(memory_gb)} in {where}: "
            f"use gpus 0-{MAX_GPUS}, cpus 1-{MAX_CPUS} and memory_gb 0-{MAX_MEMORY_GB}"
        )
    return Configuration(name, gpus=gpus, cpus=cpus, memory_gb=float(memory_gb), gpu_model=gpu_model)


def _whole(fields: Mapping[str, Any], field: str, default: int) -> int:
    """A count from YAML: 2.5, true or .inf are mistakes to report, not numbers to truncate."""
    value = fields.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}: {_shown(value)} is not a whole number")
    return value


def _number(fields: Mapping[str, Any], field: str, default: float) -> int | float:
    value = fields.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field}: {_shown(value)} is not a number")
    return value


def _text(fields: Mapping[str, Any], field: str, default: str) -> str:
    value = fields.get(field, default)
    if isinstance(value, (list, dict)):
        raise ValueError(f"{field}: {_shown(value)} is not text")
    return "" if value is None else str(value)


def _shown(value: Any) -> str:
    """A value as an error message shows it: its repr, cut short when long (an integer of
    thousands of digits is not even written out: Python refuses to)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"a number of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _stamp(path: str) -> tuple[int, ...] | None:
    """What changes when the file does (the cache key), or None when there is nothing there."""
    try:
        found = os.stat(path)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None
    return (found.st_mtime_ns, found.st_size, found.st_ino, found.st_dev)


def _natural_key(name: str) -> tuple[str, int, str]:
    family, _, size = name.partition(".")
    return (family, int(size) if size.isascii() and size.isdigit() and len(size) <= 18 else 0, size)
