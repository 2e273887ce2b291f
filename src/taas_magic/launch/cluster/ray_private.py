"""Ray's internals that taas uses, each behind one function here, where Ray offers no public way.

A Ray release that moves or drops one fails ``tests/unit/launch/test_ray_private.py``, which names Ray's
version and the module; what each is for, and what happens without it:

- ``ray._private.state.available_resources_per_node``: each node's free resources, to say how many nodes of
  a configuration are free (Ray's public ``available_resources`` sums the whole cluster). Without it, a
  run that must wait for nodes is not told how many are free.
- ``ray._private.thirdparty.pathspec``: the gitignore matcher Ray packs a folder with, so that the listing
  of the notebook's folder is exactly what Ray packs (the ``pathspec`` package's own releases differ).
- ``ray._private.runtime_env.packaging``: packing the notebook's folder into the cluster's store under a
  content address, and fetching it on a node; it is what Ray runs for ``runtime_env={"working_dir": …}``.
  Without it, a node unpacks the package through a runtime-environment task (public); the kernel has no
  public way to pack a folder per cell (Ray takes a local ``working_dir`` only in ``ray.init``), so a
  cell whose folder has files to send fails in one line that says what to do.
- ``ray._private.worker``: a node's runtime-environment folder and store client, to fetch the package in
  the agent itself (milliseconds). Without it a runtime-environment task fetches it (seconds, public).
- ``ray._raylet.GcsClient``, ``Config`` and ``AuthenticationTokenLoader``: one call to a cluster's GCS before
  connecting, to tell at once whether it refuses this notebook's token authentication (``ray.init`` retries
  for 20 s and says only that it could not connect), with the variables read afresh so that a token set
  after a failed try counts. Without them (Ray before 2.52 has no token authentication) nothing is asked
  before connecting.
- ``ray._private.ray_constants.ENABLE_RAY_CLUSTER``: off while a local cluster starts its nodes, so that Ray
  in the process that starts them takes 127.0.0.1 for this machine's address instead of asking the route to
  8.8.8.8 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` does the same in the processes it starts). Without it,
  that process asks the route as Ray's check of versions begins.
- ``GcsClient.get_all_node_info``: the nodes' addresses, before connecting to a cluster through a loopback
  address, to tell at once that no node is at that address (the head on 127.0.0.2 named as
  ``localhost``), where ``ray.init`` waits a minute and says only that it could not connect. Without it,
  Ray's wait and its words.
- ``ray._private.services.start_ray_process``: to start the head's dashboard process, which Ray starts even
  without a dashboard (for its usage-statistics module), with an environment of its own. That module asks
  cloud metadata servers (169.254.169.254, metadata.google.internal) which cloud the cluster runs on, usage
  statistics on or off, unless the cluster's launch configuration (``~/ray_bootstrap_config.yaml``) names
  its provider; ``LocalCluster`` gives the dashboard a home whose configuration says "local". Without it, a
  local cluster's head asks those servers as it starts.
- ``ray._common.utils.get_default_ray_temp_dir``: the folder of Ray's sessions on this machine, where a node
  that a local cluster could not start left its raylet's last words, to say why. Without it, the failure says
  only what Ray's start said ("timed out during startup").
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

PRIVATE = {
    "ray._private.state": ("available_resources_per_node",),
    "ray._private.thirdparty.pathspec": ("PathSpec",),
    "ray._private.runtime_env.packaging": (
        "get_uri_for_directory",
        "pin_runtime_env_uri",
        "package_exists",
        "create_package",
        "upload_package_to_gcs",
        "download_and_unpack_package",
    ),
    "ray._private.worker": ("global_worker", "_global_node"),
    "ray._private.services": ("start_ray_process",),
    "ray._private.ray_constants": ("PROCESS_TYPE_DASHBOARD", "ENABLE_RAY_CLUSTER"),
    "ray._common.utils": ("get_default_ray_temp_dir",),
}
# Where Ray has token authentication (2.52 and later: ``ray.exceptions.AuthenticationError``), these too.
TOKEN_AUTHENTICATION = {"ray._raylet": ("GcsClient", "Config", "AuthenticationTokenLoader")}


def free_resources_per_node() -> dict[str, dict[str, float]]:
    """Each node's free resources, as this process's connection to the cluster sees them."""
    state = importlib.import_module("ray._private.state")
    return {node_id: dict(free) for node_id, free in state.available_resources_per_node().items()}


def gitignore_rules(lines: list[str]) -> Any:
    """Gitignore-syntax patterns, matched as Ray matches them when it packs a folder."""
    return importlib.import_module("ray._private.thirdparty.pathspec").PathSpec.from_lines("gitwildmatch", lines)


def packaging() -> Any:
    """Ray's packing, uploading and fetching of runtime-environment packages (untyped: internal)."""
    return importlib.import_module("ray._private.runtime_env.packaging")


def worker() -> Any:
    """Ray's worker module of this process: its node and its store client (untyped: internal)."""
    return importlib.import_module("ray._private.worker")


def runtime_env_folder() -> str:
    """Where this node of Ray keeps the runtime environments' files (those of working directories among them)."""
    return str(worker()._global_node.get_runtime_env_dir_path())


def sessions_folder() -> str:
    """Where Ray keeps the sessions (and their logs) of the nodes this process starts."""
    return str(importlib.import_module("ray._common.utils").get_default_ray_temp_dir())


def gcs_client() -> Any:
    """This process's client of the cluster's GCS (untyped: internal)."""
    return worker().global_worker.gcs_client


@contextmanager
def dashboard_environment(variables: Mapping[str, str]) -> Iterator[None]:
    """Ray's dashboard process, if this process starts one in the block (a head node's), gets ``variables`` in
    its environment; no other process does."""
    services = importlib.import_module("ray._private.services")
    dashboard = importlib.import_module("ray._private.ray_constants").PROCESS_TYPE_DASHBOARD
    start = services.start_ray_process
    signature = inspect.signature(start)

    def starting(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        if call.arguments["process_type"] == dashboard:
            call.arguments["env_updates"] = {**(call.arguments.get("env_updates") or {}), **variables}
        return start(*call.args, **call.kwargs)

    setattr(services, "start_ray_process", starting)
    try:
        yield
    finally:
        setattr(services, "start_ray_process", start)


@contextmanager
def no_address_probe() -> Iterator[None]:
    """In the block, Ray in this process takes 127.0.0.1 for this machine's address where it would ask the
    route to 8.8.8.8 for one (a local cluster's nodes, all on loopback, are started meanwhile)."""
    constants: Any = importlib.import_module("ray._private.ray_constants")  # untyped: internal
    before = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = before


class TokenRefused(Exception):
    """The cluster's GCS refused this process's token authentication (none, or not the cluster's)."""


def read_authentication_anew() -> None:
    """Ray's token-authentication variables (``RAY_AUTH_MODE``, the token) read afresh by this process: Ray
    reads them once and keeps the token it found. Nothing on a Ray without token authentication."""
    raylet = importlib.import_module("ray._raylet")
    if hasattr(raylet, "AuthenticationTokenLoader"):
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()


def ask_gcs(address: str, timeout: float) -> None:
    """One read from the GCS at ``address`` (``HOST:PORT``), with Ray's authentication variables read afresh;
    raises ``TokenRefused`` if the GCS refuses this process's token, and nothing else for any other reason
    (``ray.init`` says what is wrong then). Only before this process connects to Ray."""
    refusal = getattr(importlib.import_module("ray.exceptions"), "AuthenticationError", None)
    if refusal is None:
        return  # a Ray without token authentication
    read_authentication_anew()
    try:
        importlib.import_module("ray._raylet").GcsClient(address=address).internal_kv_get(
            b"taas", None, timeout=timeout
        )
    except refusal as e:
        raise TokenRefused(str(e)) from None
    except Exception:
        return


def node_addresses(address: str, timeout: float) -> list[tuple[str, bool]] | None:
    """The alive nodes of the cluster whose GCS is at ``address``, each (its address, whether it is the head);
    None when the GCS does not say. Only before this process connects to Ray."""
    try:
        nodes = importlib.import_module("ray._raylet").GcsClient(address=address).get_all_node_info(timeout=timeout)
        return [
            (str(info.node_manager_address), bool(info.is_head_node))
            for info in nodes.values()
            if info.state == getattr(info, "ALIVE", 0)
        ]
    except Exception:
        return None


def missing() -> list[str]:
    """Ray's internals of ``PRIVATE`` (and ``TOKEN_AUTHENTICATION``, where Ray has it) that this Ray lacks,
    as ``module.name``."""
    absent = []
    wanted = dict(PRIVATE)
    if hasattr(importlib.import_module("ray.exceptions"), "AuthenticationError"):
        wanted.update(TOKEN_AUTHENTICATION)
    for module_name, names in wanted.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            absent.append(module_name)
            continue
        absent += [f"{module_name}.{name}" for name in names if not hasattr(module, name)]
    return absent
