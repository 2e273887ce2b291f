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
- ``ray._private.worker``: a node's runtime-environment folder and store client, to fetch the package in
  the agent itself (milliseconds). Without it a runtime-environment task fetches it (seconds, public).
"""

from __future__ import annotations

import importlib
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
}


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


def missing() -> list[str]:
    """Ray's internals of ``PRIVATE`` that this Ray lacks, as ``module.name``."""
    absent = []
    for module_name, names in PRIVATE.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            absent.append(module_name)
            continue
        absent += [f"{module_name}.{name}" for name in names if not hasattr(module, name)]
    return absent
