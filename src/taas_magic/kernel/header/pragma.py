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
import tokenize
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from taas_magic.errors import TaasUsageError

_SHEBANG = re.compile(r"#!\s*(?P<name>\S+)\s*")
TEXT_MAGICS = {
    "writefile",
    "file",
    "bash",
    "sh",
    "script",
    "perl",
    "ruby",
    "python",
    "python2",
    "python3",
    "pypy",
    "html",
    "javascript",
    "js",
    "latex",
    "markdown",
    "svg",
}
_PRAGMA = re.compile(r"#\s*pragma\s+taas(?!\S)")  # a prefix: the options are the rest of the line


@dataclass(frozen=True)
class Header:
    """What a cell's leading lines ask for, and where they are."""

    first_line: int  # index of the first header line (after leading blank lines)
    line_count: int  # 1 or 2
    configuration: str | None
    options: str | None  # the pragma's options; None when the cell has no pragma


def transform(lines: list[str], is_configuration: Callable[[str], bool], on_cluster: bool = False) -> list[str]:
    """Rewrite a taas cell's header into a `%%taas` (or `%taas --check`) call; else return ``lines``.

    ``on_cluster``: a cluster is connected, so `#!NAME` alone runs the cell as one process on a
    node of NAME (`%%taas --config NAME --alone`) instead of here.
    """
    header = parse_header(lines, is_configuration)
    if header is None:
        return lines
    rest = lines[header.first_line + header.line_count :]
    if header.options is None and on_cluster:
        return [f"%%taas --config {header.configuration} --alone\n"] + ["\n"] * header.first_line + rest
    if header.options is None:
        check = f"%taas --check {header.configuration}\n"
        return lines[: header.first_line] + [check] + rest
    magic = " ".join(
        part for part in ("%%taas", header.configuration and f"--config {header.configuration}", header.options) if part
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
        pragma = _pragma_options(text)
        if shebang and configuration is None:
            configuration = shebang["name"]
        elif pragma is not None and options is None:
            options = pragma
        else:
            break
        count += 1
    if options is None and (configuration is None or not is_configuration(configuration)):
        # A shebang alone is ours only if it names a configuration: `#!/usr/bin/env python` is not.
        return None
    return Header(first, count, configuration, options)


def misplaced_pragma(lines: list[str], header: Header | None) -> int | None:
    """The 1-based line of a `#pragma taas` comment that is not in the cell's header, if any.

    Only real comments count: a line of a multi-line string that reads `#pragma taas` is text,
    and so is the body of a cell magic that is not this kernel's Python (`%%bash`, `%%writefile`).
    Under `%%time` or `%%capture` a pragma would be silently ignored: that is still an error.
    The tokenizer is asked only when a line looks like a pragma, so ordinary cells cost a scan.
    """
    if header is None and _text_magic(lines):
        return None
    start = 0 if header is None or header.options is None else header.first_line + header.line_count
    suspects = [index for index in range(start, len(lines)) if _pragma_options(lines[index]) is not None]
    if not suspects:
        return None
    comments = _comment_lines(lines)
    return next((index + 1 for index in suspects if index in comments), None)


def _text_magic(lines: list[str]) -> bool:
    """Whether the cell starts with a cell magic whose body is text to this kernel: a file, a
    script for another program, markup."""
    first = next((line for line in lines if line.strip()), "").strip()
    return first.startswith("%%") and first[2:].split(" ", 1)[0] in TEXT_MAGICS


def _pragma_options(line: str) -> str | None:
    """The options of a `#pragma taas` line ("" for none), or None for any other line."""
    text = line.rstrip("\r\n")
    found = _PRAGMA.match(text)
    return None if found is None else text[found.end() :].strip()


def _comment_lines(lines: list[str]) -> set[int]:
    """Indices of the lines that begin with a comment token: not inside a string.

    A cell is IPython input, not always Python (`!echo it's`, stray indentation): where the
    tokenizer gives up, it starts afresh on the next line, so a comment further down still
    counts. In an unterminated multi-line string, everything below is text.
    """
    found: set[int] = set()
    start = 0
    while start < len(lines):
        try:
            for token in tokenize.generate_tokens(iter(lines[start:]).__next__):
                if token.type == tokenize.COMMENT and token.start[1] == 0:
                    found.add(start + token.start[0] - 1)
            break
        except (tokenize.TokenError, SyntaxError) as e:
            if "multi-line string" in str(e) or "triple-quoted" in str(e):
                break
            start += max(_error_line(e), 1)  # on past the line it failed on
    return found


def _error_line(error: Exception) -> int:
    """The 1-based line a tokenizer error is about (0 when it does not say)."""
    if isinstance(error, SyntaxError):
        return error.lineno or 0
    position = error.args[1] if len(error.args) > 1 else None
    return position[0] if isinstance(position, tuple) and position and isinstance(position[0], int) else 0


class PragmaTransformer:
    """The transformer IPython calls; raises for a pragma below real code rather than run it silently.

    ``has_side_effects`` keeps IPython's completeness check (used while typing in a console)
    from calling it: only a real run should report a misplaced pragma.
    """

    has_side_effects = True

    def __init__(self, is_configuration: Callable[[str], bool], on_cluster: Callable[[], bool] = lambda: False):
        self.is_configuration = is_configuration
        self.on_cluster = on_cluster  # whether `#!NAME` alone runs on a cluster node
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
        return transform(lines, self.is_configuration, self.on_cluster())
