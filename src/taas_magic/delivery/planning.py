"""In the kernel: which registered loaders a cell uses, and what it asks of them."""

from __future__ import annotations

import ast
from typing import Any

from ..errors import TaasUsageError
from ..spec import LaunchSpec
from .service import LoaderPlan


def loaders_used(tree: ast.AST, namespace: dict[str, Any]) -> list[str]:
    """Names the cell reads that refer to registered DataLoaders."""
    from taas.registry import is_registered

    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return sorted(name for name in read if name in namespace and is_registered(namespace[name]))


def plans(spec: LaunchSpec, names: list[str], namespace: dict[str, Any]) -> tuple[LoaderPlan, ...]:
    """One plan per registered loader the cell uses; ``--cpus 0`` turns delivery off."""
    producers = 1 if spec.cpus is None else spec.cpus
    if producers == 0:
        return ()
    for name in names:
        _check_servable(name, namespace[name], producers)
    return tuple(LoaderPlan(name, producers, spec.units, spec.prefetch, spec.order == "fastest") for name in names)


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
