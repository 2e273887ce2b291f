"""pdb inside a rank, typed into from the notebook.

A rank has no terminal: its debugger's input comes from the kernel. Each line it needs is one
``Prompt`` on the rank's control channel (``wire/rank_control.py``); the kernel asks its front end
for the line (Jupyter's stdin request: JupyterLab, Notebook, VS Code and terminal IPython all
answer it) and sends back a ``Line``. The debugger's output is the rank's output, shown live in
the cell like any other.
"""

from __future__ import annotations

import linecache
import os
import pdb
import sys
from types import FrameType
from typing import Any

from taas_magic.process.child import flush_all
from taas_magic.wire.channel import ChannelBroken
from taas_magic.wire.rank_control import Line, Prompt, RankEnd


class _KernelInput:
    """A file whose lines are typed in the notebook: what pdb reads when it is given ``stdin``."""

    def __init__(self, control: RankEnd, prompt: str):
        self.control = control
        self.prompt = prompt

    def readline(self) -> str:
        flush_all()  # what the debugger printed comes before its prompt
        try:
            self.control.send(Prompt(self.prompt))
            while True:
                message, fds = self.control.receive()
                for fd in fds:
                    os.close(fd)
                if isinstance(message, Line):
                    return f"{message.line}\n"
        except ChannelBroken:
            return ""  # end of input: pdb quits


class _ListingPdb(pdb.Pdb):
    """pdb that shows the lines around where it stopped, as IPython's debugger does.

    A rank forked from the kernel debugs with IPython's debugger (ipykernel makes it ``pdb.Pdb``
    there). A rank started fresh (the fork server, a cluster node) has the plain one, which shows
    only the ``->`` line: the same view in every rank needs the listing here.
    """

    context = 5  # lines shown, the current one among them (IPython's default)

    def print_stack_entry(self, frame_lineno: tuple[FrameType, int], prompt_prefix: str = pdb.line_prefix) -> None:
        frame, lineno = frame_lineno
        lines = linecache.getlines(frame.f_code.co_filename, frame.f_globals) if lineno else []
        if not lines:
            super().print_stack_entry(frame_lineno, prompt_prefix)
            return
        header = self.format_stack_entry(frame_lineno, "\n-> ").split("\n-> ", 1)[0]  # file(line)function()
        self.message(("> " if frame is self.curframe else "  ") + header)
        start = max(0, min(lineno - 1 - self.context // 2, len(lines) - self.context))
        width = len(str(min(len(lines), start + self.context)))
        for number in range(start + 1, min(len(lines), start + self.context) + 1):
            marker = "---->" if number == lineno else ""
            self.message(f"{marker:>5} {number:>{width}} {lines[number - 1].rstrip()}")


def _left_by_interrupts(base: type[pdb.Pdb]) -> type[pdb.Pdb]:
    """``base`` whose prompt an interrupt leaves as ``q`` does. In a rank, an interrupt at the prompt comes
    from the kernel stopping the cell (another rank failed, --timeout, the user): pdb would prompt again,
    and IPython's debugger would go on with the cell as if the user had typed ``c``."""

    class RankPdb(base):  # type: ignore[valid-type,misc]
        def _cmdloop(self) -> None:
            try:
                self.cmdloop()
            except KeyboardInterrupt:
                self.message("--KeyboardInterrupt--")
                self.do_quit("")

    return RankPdb


def _debugger(control: RankEnd) -> pdb.Pdb:
    rank = os.environ.get("RANK", "?")
    debugger_class = pdb.Pdb if pdb.Pdb.__module__ != "pdb" else _ListingPdb  # IPython's lists the lines itself
    # nosigint: after `c`, pdb would take SIGINT for itself (to break in again), and an interrupt or --timeout
    # from the kernel would no longer stop the cell.
    debugger = _left_by_interrupts(debugger_class)(
        stdin=_KernelInput(control, f"[rank {rank}] (Pdb) "),  # type: ignore[arg-type]  # a file to pdb: readline
        stdout=sys.stdout,
        nosigint=True,
    )
    debugger.prompt = ""  # the kernel shows the prompt with its input box
    return debugger


def post_mortem(error: BaseException, control: RankEnd) -> None:
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


def take_breakpoints(control: RankEnd) -> None:
    """`breakpoint()` in the cell stops this rank in the debugger, typed into from the notebook.

    PYTHONBREAKPOINT=0 turns breakpoints off here as it does anywhere.
    """
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return

    def breakpointhook(*args: Any, **kwargs: Any) -> None:
        _debugger(control).set_trace(sys._getframe(1))

    sys.breakpointhook = breakpointhook
