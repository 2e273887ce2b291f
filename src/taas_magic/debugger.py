"""pdb inside a rank, typed into from the notebook.

A rank has no terminal: its debugger's input comes from the kernel. Each line it needs is one
("input", prompt) request on the rank's control channel; the kernel asks its front end for the
line (Jupyter's stdin request: JupyterLab, Notebook, VS Code and terminal IPython all answer
it) and sends back ("line", text). The debugger's output is the rank's output, shown live in
the cell like any other.
"""

from __future__ import annotations

import os
import pdb
import sys
from typing import Any

from .channel import Channel, ChannelBroken
from .child import flush_all


class _KernelInput:
    """A file whose lines are typed in the notebook: what pdb reads when it is given ``stdin``."""

    def __init__(self, control: Channel, prompt: str):
        self.control = control
        self.prompt = prompt

    def readline(self) -> str:
        flush_all()  # what the debugger printed comes before its prompt
        try:
            self.control.send("input", self.prompt)
            while True:
                kind, fields, fds = self.control.receive()
                for fd in fds:
                    os.close(fd)
                if kind == "line":
                    return f"{fields[0]}\n"
        except ChannelBroken:
            return ""  # end of input: pdb quits


def _debugger(control: Channel) -> pdb.Pdb:
    rank = os.environ.get("RANK", "?")
    debugger = pdb.Pdb(stdin=_KernelInput(control, f"[rank {rank}] (Pdb) "), stdout=sys.stdout)  # type: ignore[arg-type]
    debugger.prompt = ""  # the kernel shows the prompt with its input box
    return debugger


def post_mortem(error: BaseException, control: Channel) -> None:
    """The debugger at the frame that raised ``error``, with its locals; returns when the user quits."""
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None  # not taas's own frame
    if tb is None:
        print(f"taas: {type(error).__name__} has no frame of the cell's to debug")
        return
    rank = os.environ.get("RANK", "?")
    print(f"taas: debugging rank {rank} at {type(error).__name__}: {error} (q or EOF returns to the notebook)")
    debugger = _debugger(control)
    debugger.reset()
    debugger.interaction(None, tb)


def take_breakpoints(control: Channel) -> None:
    """`breakpoint()` in the cell stops this rank in the debugger, typed into from the notebook.

    PYTHONBREAKPOINT=0 turns breakpoints off here as it does anywhere.
    """
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return

    def breakpointhook(*args: Any, **kwargs: Any) -> None:
        _debugger(control).set_trace(sys._getframe(1))

    sys.breakpointhook = breakpointhook
