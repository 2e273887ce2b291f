"""The notebook's folder on every node of a run: what travels, packed by Ray, unpacked once per node.

    kernel: the folder (its current directory) listed with the excludes ──► one line if too large
    driver: listed again ─► Ray's content-hashed package (a zip in the cluster's GCS), made when the listing changed
    agent:  the package fetched and unpacked once per node into Ray's runtime-environment folder
            (``working_dir_files``, where Ray puts a ``working_dir``) ──► copied into each run's folder

The ranks import the notebook's modules from the unpacked package (first on their ``sys.path``) and
read its files by relative path from their run folder, which starts as a copy of it: a run writes
into its own copy, never into the package later runs share, and only what rank 0 wrote or changed
travels back (``Stamps``). Ray's own packaging does the hashing, the upload and the unpacking, so a
folder whose content did not change is neither uploaded nor unpacked again.

What stays behind: ``.git``, virtual environments (``.venv``, ``venv``, any folder holding a
``pyvenv.cfg``), ``__pycache__``, ``.ipynb_checkpoints``, the notebooks themselves (``*.ipynb``:
Jupyter saves them every few minutes, which would make a new package each time), links to folders,
files over ``FILE_LIMIT``, and what ``.taasignore`` names (else the ``.gitignore`` files), in
gitignore syntax. Ray imports lazily here: the kernel lists, its cluster driver lists and packs.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from taas_magic.errors import TaasUsageError, first_line
from taas_magic.launch.cluster import ray_private

FILE_LIMIT = 10 * 1024**2  # a file this large or larger stays behind (Ray itself warns about such files)
FOLDER_LIMIT = 100 * 1024**2  # what travels, in all: every change is a new package in the GCS's memory
FILES_LIMIT = 20_000  # files that travel: past this, listing and packing would slow every cell
IGNORE_FILE = ".taasignore"
ALWAYS_BEHIND = frozenset({".git", ".venv", "venv", "__pycache__", ".ipynb_checkpoints"})
NOTEBOOK_SUFFIX = ".ipynb"
SHOWN = 3  # the biggest items an error names

Stamps = dict[str, tuple[int, int, int]]  # a run folder's files as copied: (inode, size, mtime_ns) by relative path


@dataclass
class Listing:
    """What of ``folder`` travels: its files (relative path, size, mtime_ns), sorted; the outermost
    paths left behind (Ray's excludes); the files left behind for their size."""

    folder: str
    files: list[tuple[str, int, int]] = field(default_factory=list)
    behind: list[str] = field(default_factory=list)
    too_big: list[tuple[str, int]] = field(default_factory=list)
    cut_short: bool = False  # more than FILES_LIMIT files: the walk stopped there

    @property
    def size(self) -> int:
        return sum(size for _, size, _ in self.files)

    def fingerprint(self) -> str:
        """Changes with any file's path, size or modification time: whether to ask Ray for a new package."""
        return hashlib.blake2b(repr((self.folder, self.files, self.behind)).encode(), digest_size=16).hexdigest()

    def excludes(self) -> list[str]:
        """What stays behind, as Ray's excludes: gitignore patterns that each match one path from the
        folder's top, whatever characters its name holds."""
        return ["/" + re.sub(r"([\\*?\[\]!#])", r"\\\1", path.replace(os.sep, "/")) for path in self.behind]

    def changed_since(self, before: "Listing") -> list[str]:
        """The paths added, removed or modified since ``before``."""
        old, new = set(before.files), set(self.files)
        return sorted({path for path, _, _ in old ^ new})


def listing(folder: str) -> Listing:
    """Walk ``folder`` as Ray will pack it, with taas's excludes."""
    found = Listing(folder)
    try:
        own_rules = _rules(folder, IGNORE_FILE)
        _walk(found, "", [("", own_rules)] if own_rules else [], use_gitignore=own_rules is None)
    except OSError as e:
        raise TaasUsageError(
            f"the notebook's folder {folder} cannot be read to send it to the cluster's nodes "
            f"({e.strerror or e}): run the notebook from a folder you can read"
        ) from None
    found.files.sort()
    return found


def _walk(found: Listing, relative: str, rules: list[tuple[str, Any]], use_gitignore: bool) -> None:
    folder = os.path.join(found.folder, relative)
    gitignore = _rules(folder, ".gitignore") if use_gitignore else None
    if gitignore is not None:
        rules = rules + [(relative, gitignore)]
    with os.scandir(folder) as entries:
        ordered = sorted(entries, key=lambda entry: entry.name)
    for entry in ordered:
        path = os.path.join(relative, entry.name)
        if len(found.files) >= FILES_LIMIT:
            found.cut_short = True
            return
        if _stays_behind(entry, path, rules):
            found.behind.append(path)
        elif entry.is_dir(follow_symlinks=False):
            _walk(found, path, rules, use_gitignore)
        else:
            status = entry.stat()  # a link's target
            if status.st_size >= FILE_LIMIT:
                found.behind.append(path)
                found.too_big.append((path, status.st_size))
            else:
                found.files.append((path, status.st_size, status.st_mtime_ns))


def _stays_behind(entry: os.DirEntry[str], path: str, rules: list[tuple[str, Any]]) -> bool:
    """Left out by name, kind or an ignore file. Folders and files that cannot be read stay behind
    too: Ray's packing would fail on them (and would wait forever on a FIFO)."""
    try:
        is_dir = entry.is_dir()  # a link's target
        if entry.name in ALWAYS_BEHIND or (is_dir and entry.is_symlink()):
            return True
        if is_dir:
            if os.path.exists(os.path.join(entry.path, "pyvenv.cfg")) or not os.access(entry.path, os.R_OK | os.X_OK):
                return True
        elif not entry.is_file() or entry.name.endswith(NOTEBOOK_SUFFIX) or not os.access(entry.path, os.R_OK):
            return True
    except OSError:
        return True
    return any(_matches(spec, os.path.relpath(path, base) if base else path, is_dir) for base, spec in rules)


def _matches(spec: Any, path: str, is_dir: bool) -> bool:
    return bool(spec.match_file(path) or (is_dir and spec.match_file(path + "/")))


def _rules(folder: str, name: str) -> Any:
    """The gitignore-syntax patterns of ``folder/name`` (Ray's own matcher), or None without that file."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as file:
        return ray_private.gitignore_rules(file.read().splitlines())


def check(found: Listing) -> None:
    """One line, before anything starts, when the folder is too large to travel."""
    how = (
        f"list what the ranks do not need in {os.path.join(found.folder, IGNORE_FILE)} (gitignore syntax, "
        "such as data/), or run the notebook from a smaller folder"
    )
    if found.cut_short:
        counts = _by_top_item(found, lambda size: 1)
        items = ", ".join(f"{name} ({count} file{'s' * (count != 1)})" for name, count in counts)
        raise TaasUsageError(
            f"the notebook's folder {found.folder} has more than {FILES_LIMIT} files to send to the "
            f"cluster's nodes; the most are in {items}: {how}"
        )
    if found.size > FOLDER_LIMIT:
        sizes = _by_top_item(found, lambda size: size)
        items = ", ".join(f"{name} ({_size(size)})" for name, size in sizes)
        raise TaasUsageError(
            f"the notebook's folder {found.folder} has {_size(found.size)} to send to the cluster's "
            f"nodes, more than {_size(FOLDER_LIMIT)}; the biggest are {items}: {how}"
        )


def _by_top_item(found: Listing, weight: Callable[[int], int]) -> list[tuple[str, int]]:
    """The folder's top-level files and folders (``data/``) that weigh most, heaviest first."""
    totals: dict[str, int] = {}
    for path, size, _ in found.files:
        top, slash, _ = path.partition(os.sep)
        totals[top + slash] = totals.get(top + slash, 0) + weight(size)
    return sorted(totals.items(), key=lambda item: (-item[1], item[0]))[:SHOWN]


def _size(size: int) -> str:
    """A size as a person reads it: 24 bytes, 4.9 KiB, 110.0 MiB, 1.2 GiB."""
    if size < 1024:
        return f"{size} bytes"
    amount = size / 1024
    for unit in ("KiB", "MiB"):
        if amount < 1024:
            return f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{amount:.1f} GiB"


def news_of_big_files(found: Listing) -> str:
    """The line that says which files stay behind for their size ('' when none)."""
    if not found.too_big:
        return ""
    names = ", ".join(f"{path} ({_size(size)})" for path, size in found.too_big[:SHOWN])
    more = f" and {len(found.too_big) - SHOWN} more" if len(found.too_big) > SHOWN else ""
    return (
        f"taas: {names}{more} stay{'s' * (len(found.too_big) == 1)} on this machine: files of "
        f"{_size(FILE_LIMIT)} or more do not travel to the cluster's nodes (keep them on storage the nodes share)"
    )


def news_of_changes(paths: list[str]) -> str:
    """The line that says a session's ranks did not get the notebook's changed files."""
    names = ", ".join(paths[:SHOWN]) + (f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else "")
    return (
        f"taas: {names} changed in the notebook's folder since the session started; its ranks keep the files "
        "they started with (%taas stop, then start the session again to send the new ones)"
    )


class Packages:
    """The notebook's folder as Ray packages in one cluster (the cluster driver's side): the package of the
    last listing, asked of Ray again only when the listing changed."""

    def __init__(self) -> None:
        self.last: tuple[str, str] | None = None  # (the listing's fingerprint, its package's URI)
        self.told = ""  # the last line about files left behind for their size

    def package(self, found: Listing, notify: Callable[[str], object]) -> str | None:
        """The URI of ``found``'s package, uploaded if the cluster lacks it (None: nothing travels).

        Ray keeps a package in the GCS while someone holds it, and frees it once the last hold
        expires: each node holds it for ten minutes as it fetches it (``unpacked``), and so does
        the driver before it looks whether the cluster has it, but not through Ray Client, whose
        server does not answer that call (it would wait forever).
        """
        news = news_of_big_files(found)
        if news and news != self.told:
            notify(news)
        self.told = news
        if not found.files:
            return None
        fingerprint = found.fingerprint()
        known = self.last[1] if self.last is not None and self.last[0] == fingerprint else None
        try:
            uri = self._package_in_place(found, known)
        except (AttributeError, ImportError, TypeError) as e:  # another Ray's internals
            raise TaasUsageError(
                f"Ray {_ray_version()} packs folders differently from what taas knows ({first_line(e)}), so the "
                f"notebook's folder {found.folder} cannot go to the nodes: run the cell from a folder with nothing "
                "to send (an empty one), or use a Ray release taas was tried with (see the CHANGELOG)"
            ) from None
        self.last = (fingerprint, uri)
        return uri

    def _package_in_place(self, found: Listing, known: str | None) -> str:
        """Ray's packing called in the cluster driver (milliseconds when the cluster has the package already)."""
        packaging = ray_private.packaging()
        excludes = found.excludes()
        uri = known or packaging.get_uri_for_directory(
            found.folder, excludes=excludes, **_without_gitignore(packaging.get_uri_for_directory)
        )
        if not importlib.import_module("ray.util.client").ray.is_connected():
            packaging.pin_runtime_env_uri(uri)
        if not packaging.package_exists(uri):
            _upload(packaging, uri, found.folder, excludes)
        return str(uri)


def _ray_version() -> str:
    return str(getattr(importlib.import_module("ray"), "__version__", "?"))


def _upload(packaging: Any, uri: str, folder: str, excludes: list[str]) -> None:
    """Ray's zip of ``folder`` into the cluster's GCS under ``uri``."""
    with tempfile.TemporaryDirectory(prefix="taas-package-") as scratch:
        package = Path(scratch) / "package.zip"
        packaging.create_package(folder, package, excludes=excludes, **_without_gitignore(packaging.create_package))
        packaging.upload_package_to_gcs(uri, package.read_bytes())


def _without_gitignore(function: Callable[..., Any]) -> dict[str, Any]:
    """Ray's packing reads .gitignore files unless told not to (Ray 2.46 and later): taas has applied
    its own rules already, and .taasignore replaces .gitignore."""
    return {"include_gitignore": False} if "include_gitignore" in inspect.signature(function).parameters else {}


# -- on a node (the agent) ------------------------------------------------------------------------


def unpacked(uri: str, node_id: str) -> str:
    """The package's folder on this node, fetched and unpacked by Ray once per node.

    Ray's own fetch-and-unpack is called in place (milliseconds); a runtime-environment task that
    only reports its folder would do the same, and is the way when this Ray has no such function,
    but a worker started for each new package takes seconds.
    """
    try:
        return _unpacked_in_place(uri)
    except (AttributeError, ImportError, TypeError):  # another Ray's internals
        return unpacked_by_a_task(uri, node_id)


def _unpacked_in_place(uri: str) -> str:
    packaging = ray_private.packaging()
    resources = os.path.join(ray_private.runtime_env_folder(), "working_dir_files")
    packaging.pin_runtime_env_uri(uri)
    return str(asyncio.run(packaging.download_and_unpack_package(uri, resources, ray_private.gcs_client())))


def unpacked_by_a_task(uri: str, node_id: str) -> str:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(working_directory).options(
        runtime_env={"working_dir": uri}, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )
    return str(ray.get(task.remote()))


def working_directory() -> str:
    """In a Ray task whose runtime environment has a ``working_dir``: where Ray unpacked it."""
    return os.getcwd()


def copy_into(package: str, folder: str) -> Stamps:
    """Start a run's folder as a copy of the package: the run writes into its copy alone. The
    copies' stamps, to tell rank 0's writes from them afterwards."""
    shutil.copytree(package, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    stamps: Stamps = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            stamps[os.path.relpath(path, folder)] = stamp(path)
    return stamps


def stamp(path: str) -> tuple[int, int, int]:
    """What changes when a file is written or replaced."""
    status = os.stat(path)
    return status.st_ino, status.st_size, status.st_mtime_ns
