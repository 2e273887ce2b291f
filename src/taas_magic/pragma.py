"""The input transformer: `#!g2.8` / `#pragma taas …` cell headers become a `%%taas …` call.

A pure function from lines to lines, run by IPython before its own magic handling. A cell it
does not own comes back byte for byte. Line numbers are preserved, so a traceback from a rank
points at the line the user sees in the cell.

    #!g2.8                        %%taas --config g2.8 --gpus 8
    #pragma taas --gpus 8    ──►  <blank>
    train()                       train()

A `#!<configuration>` line alone becomes `%taas --check <configuration>`: the cell runs in
the kernel as usual, after a one-line warning if this machine lacks what it needs.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from .errors import TaasUsageError

_SHEBANG = re.compile(r"#!\s*(?P<name>\S+)\s*")
_PRAGMA = re.compile(r"#\s*pragma\s+taas(?:\s+(?P<options>.*?))?\s*")


@dataclass(frozen=True)
class Header:
    """What a cell's leading lines ask for, and where they are."""

    first_line: int  # index of the first header line (after leading blank lines)
    line_count: int  # 1 or 2
    configuration: str | None
    options: str | None  # the pragma's options; None when the cell has no pragma


def transform(lines: list[str], is_configuration: Callable[[str], bool]) -> list[str]:
    """Rewrite a taas cell's header into a `%%taas` (or `%taas --check`) call; else return ``lines``."""
    header = parse_header(lines, is_configuration)
    if header is None:
        return lines
    rest = lines[header.first_line + header.line_count :]
    if header.options is None:
        check = f"%taas --check {header.configuration}\n"
        return lines[: header.first_line] + [check] + rest
    magic = " ".join(
        part
        for part in ("%%taas", header.configuration and f"--config {header.configuration}", header.options)
        if part
    )
    # Blank lines stand in for the leading blanks and the second header line: line k of the
    # cell stays line k of what runs.
    padding = ["\n"] * (header.first_line + header.line_count - 1)
    return [magic + "\n"] + padding + rest


def parse_header(lines: list[str], is_configuration: Callable[[str], bool]) -> Header | None:
    """The taas header at the top of ``lines``, or None for a cell that is not ours."""
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        return None
    configuration: str | None = None
    options: str | None = None
    count = 0
    for line in lines[first : first + 2]:
        text = line.rstrip("\r\n")
        shebang = _SHEBANG.fullmatch(text)
        pragma = _PRAGMA.fullmatch(text)
        if shebang and configuration is None:
            configuration = shebang["name"]
        elif pragma and options is None:
            options = pragma["options"] or ""
        else:
            break
        count += 1
    if options is None and (configuration is None or not is_configuration(configuration)):
        # A shebang alone is ours only if it names a configuration: `#!/usr/bin/env python` is not.
        return None
    return Header(first, count, configuration, options)


def misplaced_pragma(lines: list[str], header: Header | None) -> int | None:
    """The 1-based line of a `#pragma taas` that is not in the cell's header, if any."""
    start = 0 if header is None or header.options is None else header.first_line + header.line_count
    for number, line in enumerate(lines[start:], start=start + 1):
        if _PRAGMA.fullmatch(line.rstrip("\r\n")):
            return number
    return None


class PragmaTransformer:
    """The transformer IPython calls; raises for a pragma below real code rather than run it silently.

    ``has_side_effects`` keeps IPython's completeness check (used while typing in a console)
    from calling it: only a real run should report a misplaced pragma.
    """

    has_side_effects = True

    def __init__(self, is_configuration: Callable[[str], bool]):
        self.is_configuration = is_configuration
        self.active = True

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Let IPython transform a taas cell's body without this transformer reading it as a cell."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def __call__(self, lines: list[str]) -> list[str]:
        if not self.active:
            return lines
        header = parse_header(lines, self.is_configuration)
        line = misplaced_pragma(lines, header)
        if line is not None:
            raise TaasUsageError(
                f"#pragma taas on line {line} must be at the top of the cell "
                "(first line, or second after a #!<configuration> line); the cell did not run"
            )
        return transform(lines, self.is_configuration)
