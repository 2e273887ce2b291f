"""Tab completion for `%taas` / `%%taas`: the options, and the values an option takes.

IPython asks a completer registered for the line's first word (`set_hook("complete_command")`)
and keeps the candidates that start with what is typed.
"""

from __future__ import annotations

from typing import Any, Callable

from taas_magic.configurations import load_catalog
from taas_magic.kernel.header import line_commands, options


def candidates(magic: Callable[..., Any], text_until_cursor: str, line_magic: bool) -> list[str]:
    """What may come at the cursor: on a `%taas` line, its command, then `--ranks` for `pull` and `push`; on a
    `%%taas` line, a value of the option just typed, else an option."""
    words = text_until_cursor.split()
    typing_word = bool(words) and not text_until_cursor[-1:].isspace()
    before = words[:-1] if typing_word else words
    if line_magic:
        if len(before) == 1:
            return list(line_commands.COMMANDS)
        if before[1] == "cluster" and len(before) == 2:
            return ["auto", "off", "release"]
        return ["--ranks"] if before[1] in ("pull", "push") and "--ranks" not in before else []
    previous = before[-1] if len(before) > 1 else ""
    if previous == "--config":
        return _configuration_names()
    values = options.offered_values(magic, previous) if previous.startswith("--") else None
    if values is not None:
        return values
    return options.visible_options(magic)


def _configuration_names() -> list[str]:
    try:
        return list(load_catalog().names())
    except Exception:  # a broken TAAS_CONFIG file: its own error comes when a cell runs
        return []


def completer(magic: Callable[..., Any]) -> Callable[[Any, Any], list[str]]:
    """The hook IPython calls (as a method of the shell: ``self`` first) with a completion event;
    ``magic`` is the decorated magic, whose parser knows the options and their values."""

    def complete(shell: Any, event: Any) -> list[str]:
        line = getattr(event, "text_until_cursor", None) or event.line
        return candidates(magic, line, line_magic=not line.lstrip().startswith("%%"))

    return complete
