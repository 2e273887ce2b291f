"""The messages the docs quote are the ones taas says: each quoted message is made here by the code that says it,
and compared, so that a change of wording in one place is a failing test until the other follows."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import re

import pytest
from support.specs import cpu_spec

from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header import line_commands, options
from taas_magic.kernel.magics import TaasMagics
from taas_magic.kernel.running import delivery_planning

DOCS = pathlib.Path(__file__).parents[2] / "docs"
README = DOCS.parent / "README.md"
# A row of a table of mistakes: | `the options` | `the message` |
MISTAKE = re.compile(r"^\| `(?P<typed>--[^`|]+)` \| `(?P<said>[^`]+)` \|", re.MULTILINE)


def quoted(pattern: str) -> list[tuple[str, str]]:
    """Every place in the docs (file name, the quote) whose text matches ``pattern``, up to the quote's end."""
    found = []
    for page in sorted(DOCS.glob("*.md")) + [README]:
        for match in re.finditer(pattern, page.read_text()):
            found.append((page.name, match[0]))
    return found


def parsing_error(line: str) -> str | None:
    """What parsing ``line`` as a cell's options says, if it refuses it."""
    try:
        options.parse(TaasMagics.taas, line)
    except TaasUsageError as e:
        return str(e)
    return None


def test_every_mistake_of_parsing_the_docs_quote_is_said_as_quoted():
    rows = [match for page in sorted(DOCS.glob("*.md")) for match in MISTAKE.finditer(page.read_text())]
    checked = 0
    for row in rows:
        said = parsing_error(row["typed"])
        if said is None:
            continue  # refused later than parsing: by the spec, the run, a session
        assert said == row["said"].replace("…", said[len(row["said"]) - 1 :] if row["said"].endswith("…)") else "…")
        checked += 1
    assert checked >= 15, f"only {checked} rows were parsing mistakes: the table's form changed?"


def test_the_unknown_option_message_lists_every_option_as_quoted():
    real = parsing_error("--frobnicate")
    quotes = quoted(r"unknown option '--frobnicate'[^`\n]*")
    assert quotes and all(quote == real for _, quote in quotes), (real, quotes)


def test_options_that_serve_no_loader_are_said_as_quoted():
    spec = dataclasses.replace(cpu_spec(), cpus=2)
    assert spec.data_options_given
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        delivery_planning.for_cell(spec, set(), {})
    real = said.getvalue().strip()
    quotes = quoted(r"taas: --cpus/[^`\n]*have no effect[^`\n]*")
    assert quotes and all(quote == real for _, quote in quotes), (real, quotes)
    headings = quoted(r"#+ --cpus/[^\n]*have no effect")
    assert all(heading.split(" ", 1)[1] == real.split(": ")[1] for _, heading in headings), headings


def test_the_docs_list_the_line_commands_as_the_help_does():
    page = (DOCS / "options.md").read_text()
    for command in line_commands.COMMANDS.values():
        in_a_table = command.usage.replace("|", "\\|")  # a bar is escaped in a table's cell
        assert f"`{in_a_table}`" in page, command.usage


@pytest.mark.parametrize("option", options.visible_options(TaasMagics.taas))
def test_every_option_has_a_row_in_the_table_of_options(option):
    assert re.search(rf"^\| \[`{re.escape(option)}\b", (DOCS / "options.md").read_text(), re.MULTILINE), option


def test_the_readme_links_every_page_of_the_docs():
    """A user reads the README first: every page of the docs is reachable from it."""
    readme = README.read_text()
    pages = {page.name for page in DOCS.glob("*.md")} - {"index.md"}  # the docs' own table of contents
    assert {page for page in pages if f"(docs/{page}" not in readme} == set()
