"""torch keeps each sparse tensor that pickle rebuilds until its next ``torch.load``: taas's loads let go.

torch rebuilds a pickled sparse tensor without checking its invariants and appends it to a list of its
module ``torch._utils`` (``_sparse_tensors_to_validate``), for ``torch.load`` to check and empty once it
has read the tensor's storages. Unpickled anywhere else, as taas unpickles what crosses between its
processes, the tensor stays on that list: alive after the notebook or the rank drops it (a loader of
sparse batches would keep every batch of a pass), and the next ``torch.load``, of anything, checks it
and warns about sparse tensors it did not load. What taas unpickles was made by torch in taas's own
processes, so there is nothing to check: each load takes what it added off the list.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def forgotten() -> Iterator[None]:
    """Around an unpickling: the sparse tensors it rebuilt are torch's to keep no longer.

    What torch kept before stays, by identity: torch may check and empty its list meanwhile (a storage
    that plain pickle wrote is read back by a ``torch.load``), so a count from before would not say
    which are new."""
    before = {id(tensor) for tensor in _kept_by_torch()}  # alive, held by the list: the ids stay theirs
    try:
        yield
    finally:
        kept = _kept_by_torch()
        kept[:] = [tensor for tensor in kept if id(tensor) in before]


def _kept_by_torch() -> list[Any]:
    """torch's list (an empty one while torch is not imported, or if a release has none)."""
    kept = getattr(sys.modules.get("torch._utils"), "_sparse_tensors_to_validate", None)
    return kept if isinstance(kept, list) else []
