"""Notebook names bound to the functions ranks replace (``torch.save``, ``init_process_group``).

A rank replaces a few torch functions (only rank 0 writes files; ``nccl`` is served by gloo on
CPU), and a notebook may hold them under names of its own (``from torch import save``). Those
names are found in the kernel, while the run's supervisor forks the ranks, and reach them
through their start gates: a rank that walked the notebook's whole namespace would touch every
object in it and copy every page they lie on, tens of milliseconds per rank in a notebook that
holds tens of thousands of names.
"""

from __future__ import annotations

from typing import Any


def find(namespace: dict[str, Any]) -> tuple[str, ...]:
    """In the kernel: the names in ``namespace`` bound to a function that ranks replace."""
    import torch
    import torch.distributed as dist

    # Identities compared in C (map, set, list.index): a notebook of tens of thousands of names
    # takes a millisecond; a loop of Python over them would take several.
    identities = list(map(id, namespace.values()))
    found = {id(torch.save), id(dist.init_process_group)}.intersection(identities)
    if not found:
        return ()
    names = list(namespace)
    return tuple(names[index] for identity in found for index in _indices(identities, identity))


def _indices(values: list[int], value: int) -> list[int]:
    found: list[int] = []
    start = 0
    while True:
        try:
            start = values.index(value, start) + 1
        except ValueError:
            return found
        found.append(start - 1)


def rebind(namespace: dict[str, Any], names: tuple[str, ...] | None, original: Any, replacement: Any) -> None:
    """In a rank: names bound to ``original`` now name ``replacement``; only ``names`` are looked at, if known."""
    for name in list(namespace) if names is None else names:
        if namespace.get(name) is original:
            namespace[name] = replacement
