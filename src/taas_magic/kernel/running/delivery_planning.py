"""In the kernel: which registered loaders a cell uses, and what it asks of them."""

from __future__ import annotations

import sys
from typing import Any, Collection

from taas_magic.cell_names import names_reached
from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header.spec import LaunchSpec
from taas_magic.wire.task import LoaderPlan


def for_cell(spec: LaunchSpec, reads: Collection[str], namespace: dict[str, Any]) -> tuple[LoaderPlan, ...]:
    """Delivery plans for the registered loaders a one-shot cell uses."""
    none = "the cell uses no registered DataLoader (taas.register(loader) in an earlier cell)"
    return _planned(spec, loaders_used(reads, namespace), namespace, none)


def for_session(spec: LaunchSpec, namespace: dict[str, Any]) -> tuple[LoaderPlan, ...]:
    """Every registered loader the notebook names when a session starts: its producers start with the
    session and serve whichever of its cells iterate the loader."""
    none = "the notebook has no registered DataLoader (taas.register(loader) before the cell that starts the session)"
    return _planned(spec, registered_names(namespace), namespace, none)


def _planned(spec: LaunchSpec, names: list[str], namespace: dict[str, Any], none: str) -> tuple[LoaderPlan, ...]:
    """The plans of ``names``; one line if the cell's data options serve no loader (``none`` says why)."""
    if spec.data_options_given and not names:
        print(f"taas: --cpus/--units/--order/--prefetch have no effect: {none}", file=sys.stderr)
    return plans(spec, names, namespace)


def loaders_used(reads: Collection[str], namespace: dict[str, Any]) -> list[str]:
    """Registered DataLoaders the cell reads, directly or through the notebook's functions and classes."""
    from taas.registry import is_registered

    return sorted(name for name in names_reached(reads, namespace) if is_registered(namespace[name]))


def registered_names(namespace: dict[str, Any]) -> list[str]:
    """Every notebook name bound to a registered DataLoader: a session serves them all, since the
    cells that iterate them come after the one that starts it."""
    from taas.registry import is_registered

    return sorted(name for name, value in list(namespace.items()) if not name.startswith("_") and is_registered(value))


def plans(spec: LaunchSpec, names: list[str], namespace: dict[str, Any]) -> tuple[LoaderPlan, ...]:
    """One plan per registered loader the cell uses; ``--cpus 0`` turns delivery off."""
    producers = 1 if spec.cpus is None else spec.cpus
    if producers == 0:
        return ()
    for name in names:
        _check_servable(name, namespace[name], producers)
    return tuple(
        LoaderPlan(
            name,
            producers,
            spec.units,
            spec.prefetch,
            spec.order == "fastest",
            _seed(namespace[name]),
            on_demand=spec.keep,
        )
        for name in names
    )


def _seed(loader: Any) -> int:
    """The loader's own generator's seed, else the kernel's: the same whether ranks fork or spawn."""
    import torch

    generator = getattr(loader, "generator", None)
    return generator.initial_seed() if generator is not None else torch.initial_seed()


def _check_servable(name: str, loader: Any, producers: int) -> None:
    from torch.utils.data import IterableDataset

    if isinstance(loader.dataset, IterableDataset):
        raise TaasUsageError(
            f"registered loader {name!r} reads an IterableDataset, which cannot be split among producers "
            f"by element: unregister it (taas.unregister({name})) or use a map-style dataset"
        )
    try:
        length = len(loader)
    except TypeError:
        length = 0
    if length < 1:
        raise TaasUsageError(f"registered loader {name!r} yields no elements (len() is {length}): nothing to deliver")
