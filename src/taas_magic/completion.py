"""Tab completion for `%taas` / `%%taas`: the options, and the values an option takes.

IPython asks a completer registered for the line's first word (`set_hook("complete_command")`)
and keeps the candidates that start with what is typed.
"""

from __future__ import annotations

from typing import Any, Callable

from . import options
from .configurations import load_catalog

SUBCOMMANDS = ("cluster", "stop", "debug")  # `%taas WORD`


def candidates(text_until_cursor: str, option_names: list[str], line_magic: bool) -> list[str]:
    """What may come at the cursor: a value of the option just typed, else an option (or, first
    on a `%taas` line, a subcommand)."""
    words = text_until_cursor.split()
    typing_word = bool(words) and not text_until_cursor[-1:].isspace()
    before = words[:-1] if typing_word else words
    previous = before[-1] if len(before) > 1 else ""
    values = _values_of(previous)
    if values is not None:
        return values
    first = len(before) == 1
    return option_names + (list(SUBCOMMANDS) if line_magic and first else [])


def _values_of(option: str) -> list[str] | None:
    if option == "--config":
        try:
            return list(load_catalog().names())
        except Exception:  # a broken TAAS_CONFIG file: its own error comes when a cell runs
            return []
    choices = {"--device": options.DEVICES, "--output": options.OUTPUTS, "--order": options.ORDERS,
               "--on": options.PLACES, "--start": tuple(s for s in options.STARTS if s != "spawn")}
    return list(choices[option]) if option in choices else None


def completer(option_names: list[str]) -> Callable[[Any, Any], list[str]]:
    """The hook IPython calls (as a method of the shell: ``self`` first) with a completion event."""

    def complete(shell: Any, event: Any) -> list[str]:
        line = getattr(event, "text_until_cursor", None) or event.line
        return candidates(line, option_names, line_magic=not line.lstrip().startswith("%%"))

    return complete
