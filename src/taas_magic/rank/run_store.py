"""A rank's own client of the run's store, for what its session agrees with its peers between collectives.

The run's TCPStore (``launch/rendezvous.py``) is served for the whole run, on this machine or on a
cluster's node 0, at ``MASTER_ADDR:MASTER_PORT``. A session rank reaches it for the optimizer step its
ranks stop before (``stopping.py``) and for the handles that connect its process group anew
(``group_links.py``); one client serves both, made the first time one is needed.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

STORE_SECONDS = 5.0  # it answers in milliseconds; longer is a store that is gone
WAIT_SECONDS = 30.0  # how long a rank waits for its peers' keys: each is set as the peer gets there

_client: list[Any] = []


def client() -> Any:
    """The run's store, as a client (made once)."""
    if not _client:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public (documented), not in __all__

        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = TCPStore(address, port, is_master=False, timeout=timedelta(seconds=STORE_SECONDS))
        store.set_timeout(timedelta(seconds=WAIT_SECONDS))
        _client.append(store)
    return _client[0]
