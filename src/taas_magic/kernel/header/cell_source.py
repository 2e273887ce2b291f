"""A taas cell as the kernel reads it: the options line expanded, the cell compiled once, and its lines
as tracebacks quote them.

The cell is compiled in the kernel, so a syntax error is reported before any rank starts; the ranks
run that code. Line 1 stands for the `%%taas` line, so line numbers in tracebacks are the cell's own,
and the lines tracebacks quote show the header the user wrote (`#!g2.8`, `#pragma taas …`).
"""

from __future__ import annotations

import argparse
import ast
import linecache
from dataclasses import dataclass
from types import CodeType
from typing import Any, Callable

from IPython.core.interactiveshell import InteractiveShell

from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header import options
from taas_magic.kernel.header.pragma import PragmaTransformer, parse_header
from taas_magic.launch.backend import Cell
from taas_magic.process import cell_files


@dataclass(frozen=True)
class Compiled:
    """A cell compiled for the ranks, and what analysing it found."""

    code: CodeType
    cell: Cell


def expand_variables(shell: InteractiveShell, line: str) -> str:
    """IPython's `$name` / `{expression}` expansion of the options line, as in any magic.

    IPython does it by copying the notebook's whole namespace first: milliseconds in a notebook
    that holds tens of thousands of names, on every cell. Lines without `$` or `{` (nearly all)
    have nothing to expand.
    """
    if "$" not in line and "{" not in line:
        return line
    return str(
        shell.var_expand(line, depth=3)
    )  # the names seen where the magic was called (called from the magic itself)


def compile_cell(shell: InteractiveShell, transformer: PragmaTransformer, line: str, cell: str) -> Compiled:
    """Compile the cell in the kernel as IPython would (its transformers, its file for the cell), and
    analyse it once: the names it reads and binds, the notebook's namespace, its label."""
    with transformer.disabled():
        source = shell.transform_cell(f"# %%taas {line}\n{cell}")
    number = cell_files.running_cell_number(shell)
    raw = raw_cell(shell)
    typed = _header_lines(raw, cell)
    # Named after the cell as typed, as IPython names any cell: the notebook's debugger finds its breakpoints there.
    filename = shell.compile.cache(source, number, raw_code=raw if typed else None)
    if typed:
        _show_header_as_written(filename, source, raw, typed)
    tree = shell.transform_ast(ast.parse(source, filename))
    code = compile(tree, filename, "exec", dont_inherit=True)
    return Compiled(code, Cell.of(tree, shell.user_ns, f"Cell In[{number}]", filename))


def raw_cell(shell: InteractiveShell) -> str:
    """The cell as the user typed it: IPython stores it in the history before running it, without its
    trailing newlines; the kernel's request to run it has it whole (the notebook's debugger names the
    cell's file after it, newlines and all)."""
    history = getattr(shell.history_manager, "input_hist_raw", None) or [""]
    stored = str(history[-1])
    get_parent = getattr(getattr(shell, "kernel", None), "get_parent", None)
    requested = (get_parent() or {}).get("content", {}).get("code") if callable(get_parent) else None
    return requested if isinstance(requested, str) and requested.rstrip("\n") == stored.rstrip("\n") else stored


def refuse_typed_internal_options(args: argparse.Namespace, shell: InteractiveShell, magic: Callable[..., Any]) -> None:
    """``--check`` and ``--alone`` are what a lone ``#!NAME`` line becomes; typed by hand, in a
    ``#pragma taas`` line or a ``%%taas`` call, they are unknown options like any other."""
    if not (args.check or args.alone):
        return
    header = parse_header(raw_cell(shell).splitlines(keepends=True), lambda name: True)
    if header is None or header.options is not None:
        allowed = ", ".join(options.visible_options(magic))
        raise TaasUsageError(f"unknown option {'--check' if args.check else '--alone'!r}: allowed are {allowed}")


def _header_lines(raw: str, cell: str) -> int:
    """How many of the typed cell's first lines its header and the blank lines before it take, when ``raw``
    is this cell as typed (0 otherwise: the history may hold another cell, when the magic was called
    from code). The transformer (pragma.py) put one ``%%taas`` line for them, and padding for the rest."""
    lines = (raw if raw.endswith("\n") else raw + "\n").splitlines(keepends=True)
    first = next((i for i, text in enumerate(lines) if text.strip()), 0)
    header = parse_header(lines[first:], lambda name: True)
    if header is not None:
        skip = first + header.line_count
    elif lines[first : first + 1] and lines[first].lstrip().startswith("%%taas"):
        skip = first + 1
    else:
        return 0
    return skip if lines[skip:] == cell.splitlines(keepends=True)[skip - 1 :] else 0


def _show_header_as_written(filename: str, source: str, raw: str, skip: int) -> None:
    """Let tracebacks quote the user's `#!…` / `#pragma taas …` lines where the source has `# %%taas …`.

    Only the lines tracebacks quote change, not the code that runs.
    """
    lines = (raw if raw.endswith("\n") else raw + "\n").splitlines(keepends=True)
    header = parse_header(lines, lambda name: True)
    if header is None or header.options is None:
        return  # `%%taas …` as typed, or a lone `#!NAME`: the source's line says it as well
    shown = lines[:skip] + [line + "\n" for line in source.splitlines()][skip:]
    linecache.cache[filename] = (len(source), None, shown, filename)
