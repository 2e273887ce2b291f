"""Machine configurations (`g2.8`, `c1.4`, …): what one node of each offers.

The catalog ships with the package; a YAML file named by ``TAAS_CONFIG`` adds or overrides
entries field by field, so a team can describe its own machines without forking the package.
Loading is cached per (path, modification time): the transformer asks on every cell.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml

from .errors import TaasUsageError

ENV_VAR = "TAAS_CONFIG"


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
    mtime = _mtime(user_path) if user_path else None
    return _load(user_path, mtime)


@lru_cache(maxsize=8)
def _load(user_path: str, mtime: float | None) -> Catalog:
    shipped = resources.files(__package__).joinpath("configurations.yaml").read_text("utf-8")
    raw = _parse(shipped, "the shipped configurations.yaml")
    sources = ["configurations.yaml (shipped)"]
    if user_path:
        if mtime is None:
            raise TaasUsageError(f"{ENV_VAR}={user_path!r} does not name a readable file")
        try:
            text = Path(user_path).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not text
            raise TaasUsageError(f"{ENV_VAR}={user_path!r} does not name a readable file ({e})") from e
        extra = _parse(text, f"{ENV_VAR}={user_path!r}")
        raw = _merge(raw, extra)
        sources.append(user_path)
    return _build(raw, tuple(sources))


def _parse(text: str, origin: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
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
    configurations = {}
    for name, fields in raw["configurations"].items():
        try:
            configurations[str(name)] = Configuration(
                name=str(name),
                gpus=_whole(fields.get("gpus", 0)),
                cpus=_whole(fields.get("cpus", 1)),
                memory_gb=float(fields.get("memory_gb", 0)),
                gpu_model=str(fields.get("gpu_model", "")),
            )
        except (TypeError, ValueError, AttributeError) as e:
            raise TaasUsageError(f"configuration {name!r} has a bad field ({e}) in {', '.join(sources)}") from e
        found = configurations[str(name)]
        if found.gpus < 0 or found.cpus < 1 or found.memory_gb < 0:
            raise TaasUsageError(
                f"configuration {name!r} has gpus: {found.gpus}, cpus: {found.cpus}, memory_gb: {found.memory_gb:g} "
                f"in {', '.join(sources)}: use gpus >= 0, cpus >= 1 and memory_gb >= 0"
            )
    try:
        max_nodes = int(raw.get("max_nodes", 4))
    except (TypeError, ValueError) as e:
        raise TaasUsageError(f"max_nodes has a bad value ({e}) in {', '.join(sources)}") from e
    if max_nodes < 1:
        raise TaasUsageError(f"max_nodes: {max_nodes} in {', '.join(sources)}: use 1 or more")
    return Catalog(configurations, max_nodes=max_nodes, sources=sources)


def _whole(value: Any) -> int:
    """A count from YAML: 2.5 or true are mistakes to report, not numbers to truncate."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not a whole number")
    return value


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _natural_key(name: str) -> tuple:
    family, _, size = name.partition(".")
    return (family, int(size) if size.isdigit() else 0, size)
