"""The input transformer: which cells become `%%taas` / `%taas --check`, and which come back untouched."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from taas_magic.configurations import load_catalog
from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header.pragma import PragmaTransformer, parse_header, transform

CATALOG = load_catalog({})


def is_configuration(name: str) -> bool:
    return name in CATALOG


def lines_of(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def is_header_line(line: str) -> bool:
    return line.lstrip().startswith("#!") or "pragma" in line


def assert_line_numbers_kept(before: list[str], after: list[str]) -> None:
    """Line k of the cell stays line k of what runs: same length, every other line in place."""
    assert len(after) == len(before)
    for index, line in enumerate(before):
        if line.strip() and not is_header_line(line):
            assert after[index] == line, f"line {index + 1} moved or changed"


BECOMES_CELL_MAGIC = [
    pytest.param(
        "#!g2.8\n#pragma taas --gpus 8\ntrain()\n",
        "%%taas --config g2.8 --gpus 8\n\ntrain()\n",
        id="shebang-then-pragma",
    ),
    pytest.param(
        "#pragma taas --gpus 8\n#!g2.8\ntrain()\n",
        "%%taas --config g2.8 --gpus 8\n\ntrain()\n",
        id="pragma-then-shebang",
    ),
    pytest.param("#pragma taas --gpus 2\nx = 1\ny = 2\n", "%%taas --gpus 2\nx = 1\ny = 2\n", id="pragma-alone"),
    pytest.param("#pragma taas\nx = 1\n", "%%taas\nx = 1\n", id="pragma-without-options"),
    pytest.param("#!g1.1\n#pragma taas\nx = 1\n", "%%taas --config g1.1\n\nx = 1\n", id="shebang-and-bare-pragma"),
    pytest.param("\n   \n#pragma taas --gpus 2\nx = 1\n", "%%taas --gpus 2\n\n\nx = 1\n", id="leading-blank-lines"),
    pytest.param(
        "\n#!g2.8\n#pragma taas --gpus 4\nx = 1\n",
        "%%taas --config g2.8 --gpus 4\n\n\nx = 1\n",
        id="leading-blank-then-shebang-and-pragma",
    ),
    pytest.param(
        "#pragma taas --gpus {GPUS} --timeout $limit\nx = 1\n",
        "%%taas --gpus {GPUS} --timeout $limit\nx = 1\n",
        id="braces-and-dollar-kept-for-ipython",
    ),
    pytest.param(
        "#!g2.8\r\n#pragma taas --gpus 8\r\nx = 1\r\ny = 2\r\n",
        "%%taas --config g2.8 --gpus 8\n\nx = 1\r\ny = 2\r\n",
        id="crlf",
    ),
    pytest.param("#  pragma   taas   --gpus 2   \nx = 1\n", "%%taas --gpus 2\nx = 1\n", id="extra-spaces"),
    pytest.param(
        "#!  g2.8  \n#pragma\ttaas\t--gpus 2\nx\n", "%%taas --config g2.8 --gpus 2\n\nx\n", id="spaces-and-tabs"
    ),
    pytest.param("#pragma taas --gpus 2", "%%taas --gpus 2\n", id="pragma-only-no-newline"),
    # An unknown name next to a pragma is still ours: %%taas reports it with the known names.
    pytest.param("#!g9.9\n#pragma taas\nx\n", "%%taas --config g9.9\n\nx\n", id="unknown-configuration-with-pragma"),
]

BECOMES_CHECK = [
    pytest.param("#!g2.8\nx = 1\ny = 2\n", "%taas --check g2.8\nx = 1\ny = 2\n", id="shebang-alone"),
    pytest.param(
        "\n#!c1.4\r\nx = 1\r\n    y\r\n", "\n%taas --check c1.4\nx = 1\r\n    y\r\n", id="blank-then-shebang-crlf"
    ),
    pytest.param("#!g1.4", "%taas --check g1.4\n", id="shebang-only-no-newline"),
    pytest.param("#!g2.8\n#!g1.1\nx\n", "%taas --check g2.8\n#!g1.1\nx\n", id="second-shebang-is-body"),
]

UNCHANGED = [
    pytest.param("#!/usr/bin/env python\nprint(1)\n", id="unix-shebang"),
    pytest.param("#!/usr/bin/python3\nprint(1)\n", id="unix-shebang-path"),
    pytest.param("#!unknown-config\nprint(1)\n", id="unknown-configuration-alone"),
    pytest.param("x = 1\ny = 2\n", id="ordinary-code"),
    pytest.param("#pragma once\nx = 1\n", id="pragma-once"),
    pytest.param("#pragma taasX --gpus 2\nx = 1\n", id="pragma-taasX"),
    pytest.param("# pragma: no cover\nx = 1\n", id="coverage-pragma"),
    pytest.param("x = 1  #pragma taas --gpus 2\n", id="pragma-after-code-on-a-line"),
    pytest.param("s = '#!g2.8'\n", id="shebang-in-a-string"),
    pytest.param("%%time\nx = 1\n", id="other-cell-magic"),
    pytest.param("", id="empty-cell"),
    pytest.param("\n  \n\t\n", id="blank-only-cell"),
]


@pytest.mark.parametrize(("cell", "expected"), BECOMES_CELL_MAGIC)
def test_header_becomes_a_taas_cell_magic(cell: str, expected: str) -> None:
    before = lines_of(cell)
    after = transform(before, is_configuration)
    assert "".join(after) == expected
    assert_line_numbers_kept(before, after)
    assert before == lines_of(cell), "the input list was changed in place"


@pytest.mark.parametrize(("cell", "expected"), BECOMES_CHECK)
def test_configuration_shebang_alone_becomes_a_check(cell: str, expected: str) -> None:
    before = lines_of(cell)
    after = transform(before, is_configuration)
    assert "".join(after) == expected
    assert_line_numbers_kept(before, after)


@pytest.mark.parametrize("cell", UNCHANGED)
def test_cells_that_are_not_ours_come_back_untouched(cell: str) -> None:
    before = lines_of(cell)
    assert transform(before, is_configuration) is before
    assert PragmaTransformer(is_configuration)(before) is before
    assert "".join(before) == cell


@pytest.mark.parametrize(
    ("cell", "first_line", "line_count", "configuration", "options"),
    [
        pytest.param("#!g2.8\n#pragma taas --gpus 8\n", 0, 2, "g2.8", "--gpus 8", id="both"),
        pytest.param("\n\n#pragma taas\n", 2, 1, None, "", id="bare-pragma-after-blanks"),
        pytest.param("#!g2.8\nx\n", 0, 1, "g2.8", None, id="shebang-alone"),
    ],
)
def test_parse_header_reports_where_the_header_is(
    cell: str, first_line: int, line_count: int, configuration: str | None, options: str | None
) -> None:
    header = parse_header(lines_of(cell), is_configuration)
    assert header is not None
    assert (header.first_line, header.line_count, header.configuration, header.options) == (
        first_line,
        line_count,
        configuration,
        options,
    )


@pytest.mark.parametrize(
    ("cell", "line"),
    [
        pytest.param("x = 1\n#pragma taas --gpus 2\n", 2, id="below-code"),
        pytest.param("import os\n\n\n#  pragma  taas\n", 4, id="below-code-and-blanks"),
        pytest.param("#!/usr/bin/env python\n#pragma taas --gpus 2\nx\n", 2, id="after-unix-shebang"),
        pytest.param("#!g2.8\nx = 1\n#pragma taas\n", 3, id="below-a-check-shebang"),
        pytest.param("#pragma taas --gpus 2\n#pragma taas --gpus 4\n", 2, id="second-pragma-in-header"),
        pytest.param("#!g2.8\n#pragma taas --gpus 2\nx = 1\n#pragma taas --gpus 4\n", 4, id="second-pragma-in-body"),
        # real comments are found in cells that do not tokenize cleanly too
        pytest.param("x = !echo it's\n#pragma taas --gpus 2\n", 2, id="after-a-shell-escape-with-a-quote"),
        pytest.param("%time x = 1\n#pragma taas\n", 2, id="after-a-line-magic"),
        pytest.param("x?\n#pragma taas\n", 2, id="after-help-syntax"),
        pytest.param("if x:\n        a\n    b\n#pragma taas\n", 4, id="after-an-indentation-error"),
        pytest.param("x = [1,\n#pragma taas\n", 2, id="inside-open-brackets"),
        pytest.param('s = """a"""\n#pragma taas\n', 2, id="after-a-closed-string"),
        pytest.param('doc = """\n#pragma taas\n"""\n#pragma taas --gpus 2\n', 4, id="below-a-string-that-holds-one"),
        pytest.param("%%time\nx = 1\n#pragma taas\n", 3, id="in-a-python-cell-magic-body"),
    ],
)
def test_a_pragma_below_the_header_is_an_error_naming_its_line(cell: str, line: int) -> None:
    with pytest.raises(TaasUsageError) as raised:
        PragmaTransformer(is_configuration)(lines_of(cell))
    assert isinstance(raised.value, UsageError)
    message = str(raised.value)
    assert message.startswith(f"#pragma taas on line {line} must be at the top of the cell")
    assert "\n" not in message


def test_transformer_declares_side_effects() -> None:
    assert PragmaTransformer.has_side_effects is True
    assert PragmaTransformer(is_configuration).has_side_effects is True


def test_disabled_returns_lines_untouched_and_then_reactivates() -> None:
    transformer = PragmaTransformer(is_configuration)
    taas_cell = lines_of("#pragma taas --gpus 2\nx = 1\n")
    misplaced = lines_of("x = 1\n#pragma taas\n")
    with transformer.disabled():
        assert transformer(taas_cell) is taas_cell
        assert transformer(misplaced) is misplaced
    assert transformer(taas_cell) == ["%%taas --gpus 2\n", "x = 1\n"]
    with pytest.raises(TaasUsageError):
        transformer(misplaced)


def test_disabled_reactivates_after_an_exception() -> None:
    transformer = PragmaTransformer(is_configuration)
    with pytest.raises(RuntimeError), transformer.disabled():
        raise RuntimeError("inside")
    assert transformer(["#pragma taas\n"]) == ["%%taas\n"]


def test_configuration_lookup_is_the_callers() -> None:
    """A shebang is ours exactly when the given predicate says its name is a configuration."""
    asked: list[str] = []

    def only_lab(name: str) -> bool:
        asked.append(name)
        return name == "lab.2"

    assert transform(["#!lab.2\n", "x\n"], only_lab) == ["%taas --check lab.2\n", "x\n"]
    cell = ["#!g2.8\n", "x\n"]
    assert transform(cell, only_lab) is cell
    assert asked == ["lab.2", "g2.8"]


@pytest.fixture
def shell():
    """IPython's shell with the transformer registered where the extension puts it, removed afterwards."""
    ipython = InteractiveShell.instance()
    transformer = PragmaTransformer(is_configuration)
    ipython.input_transformers_cleanup.insert(0, transformer)
    try:
        yield ipython
    finally:
        ipython.input_transformers_cleanup.remove(transformer)


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        pytest.param(
            "#!g2.8\n#pragma taas --gpus 8\ntrain()\n",
            "get_ipython().run_cell_magic('taas', '--config g2.8 --gpus 8', '\\ntrain()\\n')\n",
            id="shebang-and-pragma",
        ),
        pytest.param(
            "#pragma taas --gpus {GPUS}\nx = 1\n",
            "get_ipython().run_cell_magic('taas', '--gpus {GPUS}', 'x = 1\\n')\n",
            id="pragma-with-braces",
        ),
        pytest.param(
            "#!g2.8\nx = 1\n",
            "get_ipython().run_line_magic('taas', '--check g2.8')\nx = 1\n",
            id="shebang-alone",
        ),
        pytest.param("#!/usr/bin/env python\nx = 1\n", "#!/usr/bin/env python\nx = 1\n", id="unix-shebang"),
    ],
)
def test_ipython_turns_the_transformed_cell_into_a_magic_call(shell, cell: str, expected: str) -> None:
    assert shell.transform_cell(cell) == expected


def test_ipython_reports_a_misplaced_pragma_from_transform_cell(shell) -> None:
    with pytest.raises(TaasUsageError, match=r"^#pragma taas on line 2 "):
        shell.transform_cell("x = 1\n#pragma taas --gpus 2\n")


def test_ipython_completeness_check_does_not_call_the_transformer(shell) -> None:
    """While typing, IPython asks whether input is complete; a misplaced pragma must not raise then."""
    assert shell.input_transformer_manager.check_complete("x = 1\n#pragma taas\n")[0] == "complete"


# Only real comments are pragmas: text inside a string is text, whatever it reads.

IN_A_STRING = [
    pytest.param('doc = """\n#pragma taas --gpus 2\n"""\n', id="triple-double-quotes"),
    pytest.param("doc = '''\n#pragma taas --gpus 2\n'''\n", id="triple-single-quotes"),
    pytest.param('doc = f"""{1 + 1}\n#pragma taas --gpus 2\n"""\n', id="f-string"),
    pytest.param('doc = rb"""\n#pragma taas\n"""\n', id="raw-bytes"),
    pytest.param("s = 'abc\\\n#pragma taas'\n", id="backslash-continued-string"),
    pytest.param('def f():\n    """Docs.\n\n#pragma taas --gpus 2\n    """\n', id="docstring"),
    pytest.param('doc = """\n#pragma taas --gpus 2\n', id="unterminated-string"),
    pytest.param('x = !echo it\'s\ndoc = """\n#pragma taas\n"""\n', id="string-after-ipython-syntax"),
    # the body of another cell magic is not Python: its lines are that magic's text
    pytest.param("%%writefile train.py\nimport torch\n#pragma taas --gpus 2\n", id="writefile-body"),
    pytest.param("\n%%bash\necho start\n#pragma taas --gpus 2\n", id="bash-body"),
]


@pytest.mark.parametrize("cell", IN_A_STRING)
def test_a_pragma_inside_a_multi_line_string_is_text(cell: str) -> None:
    lines = lines_of(cell)
    assert PragmaTransformer(is_configuration)(lines) is lines


def test_a_pragma_inside_a_string_of_a_taas_cell_is_text() -> None:
    cell = lines_of('#pragma taas --gpus 2\ndoc = """\n#pragma taas --gpus 4\n"""\n')
    assert PragmaTransformer(is_configuration)(cell) == ["%%taas --gpus 2\n"] + cell[1:]


@pytest.mark.parametrize(
    ("cell", "line"),
    [
        pytest.param("\n\n#!g2.8\nx=1\n#pragma taas --gpus 2", 5, id="blanks-then-check-shebang"),
        pytest.param("\n\n#pragma taas\nx=1\n#pragma taas --gpus 2\n", 5, id="blanks-then-pragma"),
        pytest.param("\n \n\t\n#!g2.8\n#pragma taas\n\nx\n#pragma taas\n", 8, id="blanks-then-full-header"),
    ],
)
def test_misplaced_pragma_line_numbers_count_leading_blank_lines(cell: str, line: int) -> None:
    with pytest.raises(TaasUsageError, match=rf"^#pragma taas on line {line} must be at the top"):
        PragmaTransformer(is_configuration)(lines_of(cell))


def test_ipython_reports_the_line_the_user_sees_after_leading_blank_lines(shell) -> None:
    with pytest.raises(TaasUsageError, match=r"^#pragma taas on line 5 "):
        shell.transform_cell("\n\n#!g2.8\nx=1\n#pragma taas --gpus 2")
    # The header's own blank lines are kept too: line 5 of the cell is line 5 of what runs.
    assert shell.transform_cell("\n\n#pragma taas --gpus 2\nx = 1\n1 / 0\n") == (
        "get_ipython().run_cell_magic('taas', '--gpus 2', '\\n\\nx = 1\\n1 / 0\\n')\n"
    )


@pytest.mark.parametrize(
    "line",
    [
        pytest.param("#pragma taas --gpus 2" + " " * 200_000 + "x", id="spaces-then-a-word"),
        pytest.param("#pragma taas" + " " * 200_000, id="trailing-spaces"),
        pytest.param("#" + " " * 200_000 + "pragma", id="spaces-after-the-hash"),
        pytest.param("#!" + "a " * 100_000, id="shebang-of-words"),
        pytest.param("s = '" + "a" * 1_000_000 + "'", id="one-megabyte-string"),
    ],
)
def test_long_lines_are_read_in_linear_time(line: str) -> None:
    transformer = PragmaTransformer(is_configuration)
    started = time.monotonic()
    for cell in ([line + "\n", "x = 1\n"], ["x = 1\n", line + "\n"], ["x = 1\n", line + "\n", "#pragma taas\n"]):
        try:
            transformer(cell)
        except TaasUsageError:
            pass
    assert time.monotonic() - started < 1


def test_pragma_options_are_the_rest_of_the_line_stripped() -> None:
    header = parse_header(["#pragma taas   --gpus 2  --timeout 5 \t\n"], is_configuration)
    assert header is not None and header.options == "--gpus 2  --timeout 5"
    assert parse_header(["#pragma taas\t\n"], is_configuration).options == ""
    assert parse_header(["#pragma taas-x\n"], is_configuration) is None


# Property: whatever the cell, the transformer returns lines or names a real misplaced pragma comment.

FRAGMENTS = st.sampled_from(
    [
        "#pragma taas --gpus 2",
        "#pragma taas",
        "#!g2.8",
        "#!/usr/bin/env python",
        "x = 1",
        '"""',
        "'''",
        "'",
        '"',
        'doc = """',
        "(",
        ")",
        "[",
        "]",
        "    ",
        "\t",
        "\\",
        "!echo it's",
        "%time x",
        "%%bash",
        "x?",
        "if x:",
        "def f():",
        "#",
        "f'{",
        "}'",
        "",
        " ",
        "$x",
        "\r",
    ]
)
CELLS = st.lists(st.lists(FRAGMENTS, max_size=4).map("".join), max_size=8).map("\n".join)


@settings(max_examples=400, deadline=None)
@given(cell=CELLS)
def test_any_cell_gives_lines_or_names_a_real_pragma_comment(cell: str) -> None:
    lines = lines_of(cell)
    before = list(lines)
    try:
        after = PragmaTransformer(is_configuration)(lines)
    except TaasUsageError as e:
        line = int(str(e).split()[4])
        assert lines[line - 1].startswith("#pragma taas")
    else:
        assert after is lines or "".join(after).lstrip().startswith(("%%taas", "%taas --check"))
    assert lines == before, "the input was changed in place"


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        ("#!c1.32\nx = 1\n", "%%taas --config c1.32 --alone\nx = 1\n"),
        ("\n\n#!g2.8\nprint(1)\n", "%%taas --config g2.8 --alone\n\n\nprint(1)\n"),
    ],
)
def test_configuration_line_alone_runs_on_a_node_while_a_cluster_is_connected(cell: str, expected: str) -> None:
    before = lines_of(cell)
    after = transform(before, is_configuration, on_cluster=True)
    assert "".join(after) == expected
    assert_line_numbers_kept(before, after)
