"""`%taas` as a line: the commands it takes, its help, and a one-line answer to every other word.

A line is read before anything acts on it, so that a typo (`%taas stopp`) is told as one, with the
command it is closest to, and a cell's option on the line (`%taas --gpus 2`), which would be parsed and then
ignored, is refused with where it belongs. The commands themselves live with what they act on (``kept``,
``cluster_link``, ``magics``); this module only names them.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Sequence

from taas_magic.errors import TaasUsageError

HELP_WORDS = ("help", "--help", "-h")  # each shows the help, as `%taas?` does
CHECK = "--check"  # what a lone `#!NAME` line becomes (pragma.py): `%taas --check NAME`
SETTINGS = ""  # `%taas` alone


@dataclass(frozen=True)
class Command:
    """One command of the line magic: how it is written, and what it does (a line each in the help)."""

    usage: str
    does: str


COMMANDS: dict[str, Command] = {
    "status": Command(
        "%taas [status]", "the version, the session, the cluster and each default, with where it came from"
    ),
    "stop": Command(
        "%taas stop", "end the session and the runs in the background (and let a rank paused by --debug go)"
    ),
    "debug": Command("%taas debug [RANK]", "pdb in a rank whose cell raised (in a session, or paused by --debug)"),
    "pull": Command("%taas pull NAMES [--ranks RANKS]", "the session's values of NAMES into the notebook"),
    "push": Command("%taas push NAMES [--ranks RANKS]", "the notebook's values of NAMES into the session's ranks"),
    "resize": Command(
        "%taas resize N", "the session goes on with N ranks: the last ones end, or new ones join with its names"
    ),
    "stacks": Command(
        "%taas stacks", "where the session's ranks and producers are, between cells or as one runs in the background"
    ),
    "runs": Command("%taas runs", "the runs in the background (--background), each in one line"),
    "wait": Command("%taas wait", "wait until every run in the background has ended; their names join the notebook"),
    "cluster": Command(
        "%taas cluster [ADDRESS | off | release]",
        "connect to a Ray cluster (auto, HOST:PORT), show it, leave it, end its idle agents",
    ),
    "version": Command("%taas version", "the installed version of taas-magic"),
    "help": Command("%taas help [COMMAND]", "this help, or one command's"),
}


def read(words: Sequence[str], cell_options: Sequence[str]) -> str:
    """The command a line's ``words`` name (a key of ``COMMANDS``, or ``CHECK``); ``SETTINGS`` for none.

    Anything else raises a one-line ``TaasUsageError``: a cell's option (one of ``cell_options``) says that it
    goes on a cell's first line; an unknown word lists the commands, with the closest one first.
    """
    if not words:
        return SETTINGS
    first = words[0]
    if first in HELP_WORDS:
        return "help"
    if first in COMMANDS:
        return first
    if first == CHECK:
        return CHECK
    option = first.split("=", 1)[0]
    if option in cell_options:
        line = " ".join(words)
        line = line if len(line) <= 60 else line[:60] + "..."
        raise TaasUsageError(
            f"{option} is an option of a taas cell, not of the line %taas: put it on the cell's first line "
            f"(%%taas {line}, or #pragma taas {line}); %taas help lists what the line takes"
        )
    raise TaasUsageError(
        f"{_unknown(first, cell_options)}: %taas takes {', '.join(COMMANDS)} (%taas help says what each does)"
    )


def _unknown(word: str, cell_options: Sequence[str]) -> str:
    """``word`` named as not a command, with what it was probably meant to be."""
    shown = word if len(word) <= 40 else word[:40] + "..."
    if word.startswith("-"):
        meant = _closest(word, ["--help", *cell_options])
        cells = " (an option of a taas cell, on its first line)" if meant in cell_options else ""
        return f"unknown option {shown!r} for the line %taas" + (f" (did you mean {meant}?{cells})" if meant else "")
    meant = _closest(word.lower(), list(COMMANDS))
    return f"%taas {shown} is not a command" + (f" (did you mean %taas {meant}?)" if meant else "")


def _closest(word: str, candidates: Sequence[str]) -> str | None:
    found = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return found[0] if found else None


def asks_help(words: Sequence[str]) -> bool:
    """``%taas pull --help``: a command followed by one help word, which shows that command's help."""
    return len(words) == 2 and words[1] in ("--help", "-h")


def help_text(cell_options: Sequence[str], command: str | None = None) -> str:
    """The line magic's help (``%taas help``), or one command's (``%taas help stop``)."""
    if command is not None:
        shown = COMMANDS[command]
        return f"{shown.usage}\n    {shown.does}"
    return "\n".join(
        [
            "taas: the line %taas takes these commands:",
            table(),
            "",
            "A taas cell runs as a distributed job: `#pragma taas --gpus 8` (or `%%taas --gpus 8`, or `#!g2.8`) on its",
            f"first line. A cell's options: {', '.join(cell_options)}.",
            "%%taas? says what each does; docs/options.md has them all, with examples.",
        ]
    )


def table() -> str:
    """The commands, one a line, their usage aligned."""
    width = max(len(command.usage) for command in COMMANDS.values()) + 2
    return "\n".join(f"  {command.usage:<{width}}{command.does}" for command in COMMANDS.values())


def help_command(words: Sequence[str]) -> str | None:
    """The command ``%taas help WORD`` asks about (None: the whole help); an unknown one is refused."""
    if not words:
        return None
    word = words[0]
    if len(words) > 1 or word not in COMMANDS:
        raise TaasUsageError(f"%taas help takes one of {', '.join(COMMANDS)}, or nothing; got {' '.join(words)[:40]!r}")
    return word


def nothing_more(command: str, words: Sequence[str]) -> None:
    """A command that takes no words refuses any, naming them."""
    if words:
        raise TaasUsageError(f"%taas {command} takes nothing more; got {' '.join(words)[:40]!r}")
