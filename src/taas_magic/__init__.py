"""taas-magic: run one notebook cell as a distributed PyTorch training job.

    %load_ext taas_magic

    #!g2.8
    #pragma taas --gpus 8
    <single-GPU training code, made distributed with init_process_group("nccl", init_method="env://")>

Loading registers the `%%taas` / `%taas` magics and the transformer for `#!`/`#pragma taas`
headers; unloading removes exactly those. ``taas_magic.__version__`` is the installed version, which
`%taas` shows on its first line.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import traceback
from typing import TYPE_CHECKING, Any

from taas_magic.configurations import load_catalog
from taas_magic.errors import RankFailed, RunTimedOut, TaasRunError, TaasUsageError
from taas_magic.kernel.header.pragma import PragmaTransformer
from taas_magic.version import VERSION as __version__  # noqa: F401  # the package's version, shown first by %taas

logging.getLogger(__name__).addHandler(logging.NullHandler())  # silent unless TAAS_LOG asks (process/logs.py)

if TYPE_CHECKING:
    from taas_magic.kernel.magics import TaasMagics

__all__ = [
    "RankFailed",
    "RunTimedOut",
    "TaasRunError",
    "TaasUsageError",
    "load_ipython_extension",
    "unload_ipython_extension",
]

_loaded: dict[int, tuple[Any, PragmaTransformer]] = {}
# The unloaded magics of each shell, until the next load takes them over or the cell ends. %reload_ext
# runs this module again in the same namespace: what is parked here survives it.
_parked: "dict[int, TaasMagics]" = globals().get("_parked", {})
_closes_at_exit: bool = globals().get("_closes_at_exit", False)  # once per process, whatever reloads this module
COMPLETED = ("%taas", "%%taas")  # the words whose lines taas completes


def _is_configuration(name: str) -> bool:
    try:
        return name in load_catalog()
    except Exception:
        return False  # a broken TAAS_CONFIG file must not break every cell; %%taas reports it


def load_ipython_extension(ipython: Any) -> None:
    from taas_magic.kernel.header import completion
    from taas_magic.kernel.magics import TaasMagics

    global _closes_at_exit
    if id(ipython) in _loaded:
        return
    if not _closes_at_exit:
        atexit.register(_close_at_exit)
        _closes_at_exit = True
    transformer = PragmaTransformer(_is_configuration)
    magics = TaasMagics(ipython, transformer)
    transformer.on_cluster = lambda: magics.link.address is not None
    parked = _parked.pop(id(ipython), None)
    if parked is not None:
        magics.take_over(parked)  # %reload_ext: the session, a paused rank and the cluster go on
    ipython.register_magics(magics)
    complete = completion.completer(TaasMagics.taas)
    for key in COMPLETED:
        ipython.set_hook("complete_command", complete, str_key=key)
    # First, before IPython drops leading blank lines: line numbers stay the ones the user sees.
    ipython.input_transformers_cleanup.insert(0, transformer)
    ipython.events.register("pre_run_cell", magics.between_cells)  # runs in the background bind their names
    _loaded[id(ipython)] = (magics, transformer)
    if magics.debugging is not None:
        magics.debugging.install()  # from now on: the debugger's requests for ranks, and a quick re-attach held
    if magics.warm_fork_server:
        magics.forkserver_backend.warm_up()  # the fork server imports torch in the background from now on


def _close_at_exit() -> None:
    """The kernel's exit (a shutdown, a restart): what the extension runs ends as ``%unload_ext`` ends it, runs in
    the background first. Without this, its processes ended with the kernel (each watches its parent), but a run on
    a cluster left its nodes' run folders, and its placement until Ray noticed the driver gone. Lines go to the
    kernel's own streams: the notebook's are closing."""
    with contextlib.redirect_stdout(sys.__stdout__), contextlib.redirect_stderr(sys.__stderr__):
        for magics in [magics for magics, _ in _loaded.values()] + list(_parked.values()):
            try:
                magics.close("the kernel is shutting down")
            except Exception:
                traceback.print_exc()


def unload_ipython_extension(ipython: Any) -> None:
    entry = _loaded.pop(id(ipython), None)
    if entry is None:
        return
    magics, transformer = entry
    _park(ipython, magics)
    if magics in ipython.configurables:  # IPython put it there, for %config: it goes with the magics
        ipython.configurables.remove(magics)
    dispatcher = ipython.strdispatchers.get("complete_command")
    for key in COMPLETED if dispatcher is not None else ():
        dispatcher.strs.pop(key, None)
    if transformer in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(transformer)
    if magics.between_cells in ipython.events.callbacks["pre_run_cell"]:
        ipython.events.unregister("pre_run_cell", magics.between_cells)
    manager = ipython.magics_manager
    for kind in ("line", "cell"):
        if manager.magics[kind].get("taas") == getattr(magics, "taas", None):
            del manager.magics[kind]["taas"]
    manager.registry.pop(type(magics).__name__, None)


def _park(ipython: Any, magics: "TaasMagics") -> None:
    """Keep what ``magics`` runs (a session, a paused rank, the cluster, the fork server) for a load that
    follows in the same cell, as ``%reload_ext`` does; otherwise it ends, in one line, once the cell ends."""
    _parked[id(ipython)] = magics

    def end_unless_taken(*_: Any) -> None:
        ipython.events.unregister("post_run_cell", end_unless_taken)
        if _parked.get(id(ipython)) is not magics:
            return  # taken over by a load
        # Its ended session stays parked: the next load's first taas cell says so, and does not run.
        magics.close("taas_magic was unloaded (%unload_ext)")

    ipython.events.register("post_run_cell", end_unless_taken)
