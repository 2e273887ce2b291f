"""A ``--profile`` run's traces on a cluster: written on each node, sent to the notebook's machine as they appear.

A rank writes its trace into a folder of its machine (``rank/profiling.py``), whole or not at all. On a
cluster that folder is the node agent's, not the kernel's: the agent lists it each time it is asked for
events and sends the traces it finds with them, so a rank's trace reaches the notebook's machine no later
than the event that says the rank's cell ended (the rank writes first, then reports). The kernel's
cluster driver writes each into the kernel's profile folder, where the traces of one machine's ranks
would have been, and the kernel merges them there.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from taas_magic.rank.profiling import TRACE_FILE


class NodeTraces:
    """The node's folder for a run's ``--profile`` traces: made as the run starts here (any cell of a session
    may ask for traces), emptied as its traces are sent, removed with the run."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.folder: str | None = None

    def open(self) -> str:
        """Where this node's ranks write their traces (``RankTask.node_traces``), made if it is not yet."""
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix=self.prefix)
        return self.folder

    def take(self) -> dict[str, bytes]:
        """The traces written whole since the last call, by file name; each is sent once."""
        found: dict[str, bytes] = {}
        if self.folder is None:
            return found
        for name in sorted(os.listdir(self.folder)):
            if not _is_trace(name):
                continue  # still being written (``.part``)
            path = os.path.join(self.folder, name)
            try:
                with open(path, "rb") as file:
                    found[name] = file.read()
                os.unlink(path)
            except OSError:
                continue
        return found

    def close(self) -> None:
        folder, self.folder = self.folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def write_into(folder: str | None, traces: dict[str, bytes]) -> None:
    """In the cluster driver, on the kernel's machine: the traces a node sent, into the run's profile folder
    (gone already: dropped)."""
    if folder is None:
        return
    for name, data in traces.items():
        if not _is_trace(name):
            continue  # only a trace's own name: nothing a node sends chooses where a file goes
        try:
            with open(os.path.join(folder, name), "wb") as file:
                file.write(data)
        except OSError:
            return  # the run's profile folder went with its cell


def _is_trace(name: str) -> bool:
    return len(name) < 64 and TRACE_FILE.fullmatch(name) is not None
