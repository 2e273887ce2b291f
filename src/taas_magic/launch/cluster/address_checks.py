"""What the kernel can know of a Ray cluster's address before anything connects: each a one-line error at once.

Ray itself says little and late: it retries an address where nothing listens for minutes, aborts its
process on a token it needs and cannot find, and waits a minute for a node at a loopback address before
it says only that it could not connect. These checks answer first, in the kernel (``driver_link.py``),
which imports no Ray, and again in the cluster driver before ``ray.init`` (``connection.py``).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket

from taas_magic.errors import TaasUsageError
from taas_magic.launch.cluster import authentication, ray_private

CONNECT_SECONDS = 5.0  # how long an address may take to answer before connecting is given up
NO_RAY = "running on a cluster needs Ray: pip install 'taas-magic[ray]'"


def check(address: str) -> str | None:
    """What the kernel can know of ``address`` before it starts a driver (and lets go of the cluster it is
    connected to), each a one-line ``TaasUsageError``: Ray not installed, a token Ray would need and not
    find (Ray's own check of that aborts its process), an address that is not one, nothing answering
    there. The host of a ``HOST:PORT`` address, else None."""
    if importlib.util.find_spec("ray") is None:  # first: without Ray, nothing else matters
        raise TaasUsageError(NO_RAY)
    missing = authentication.missing_token(address, os.environ)
    if missing is not None:
        raise TaasUsageError(missing)
    return _check_answers(address)


def _check_answers(address: str) -> str | None:
    """One line at once for an address where nothing listens (Ray itself would retry for minutes);
    the host of a ``HOST:PORT`` address, None for ``auto`` and Ray Client's ``ray://``."""
    if address == "auto":
        return None
    scheme, _, rest = address.rpartition("://")
    if scheme not in ("", "ray"):
        raise TaasUsageError(
            f"cluster address {address!r} is not HOST:PORT, ray://HOST:PORT or auto: leave out {scheme}:// "
            f"(%taas cluster {rest})"
        )
    host, _, port = rest.rpartition(":")
    if not host or not port.isdecimal():
        raise TaasUsageError(f"cluster address {address!r} is not HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as e:
        raise TaasUsageError(
            f"nothing answers at {address} ({e.strerror or e}): is Ray's head running there? "
            "(ray start --head prints the address to use)"
        ) from None
    return None if address.startswith("ray://") else host.strip("[]")


def check_token(address: str) -> None:
    """One line at once for a cluster that refuses this notebook's token authentication (``ray.init`` would
    retry for 20 s and say only that it could not connect)."""
    try:
        ray_private.ask_gcs(address, timeout=CONNECT_SECONDS)
    except ray_private.TokenRefused:
        raise TaasUsageError(authentication.refused(address, os.environ)) from None


def check_a_node_is_at(address: str, host: str) -> None:
    """One line at once where no node of the cluster is at the loopback address the notebook named (a head on
    127.0.0.2 named as ``localhost``): the notebook's Ray connects through a node at that address, and
    ``ray.init`` would wait a minute for one and say only that it could not connect."""
    nodes = ray_private.node_addresses(address, CONNECT_SECONDS)
    try:
        here = socket.gethostbyname(host)
    except OSError:
        return
    if not nodes or here in {node for node, _ in nodes}:
        return
    head = next((node for node, is_head in nodes if is_head), nodes[0][0])
    port = address.rpartition(":")[2]
    named = here if host == here else f"{here} ({host})"
    raise TaasUsageError(
        f"no node of the Ray cluster at {address} is at {named}, so this notebook cannot connect through it: "
        f"its head is at {head} (%taas cluster {head}:{port})"
    )


def is_loopback(host: str) -> bool:
    """A host on this machine's loopback (``localhost``, ``127.x``, ``::1``): the notebook runs on that node."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
