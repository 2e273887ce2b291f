"""The line `%taas`: which words are its commands, its help, and the one line every other word gets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header import line_commands, options
from taas_magic.kernel.header.line_commands import COMMANDS, help_text, read
from taas_magic.kernel.magics import TaasMagics

CELL_OPTIONS = options.visible_options(TaasMagics.taas)


@pytest.mark.parametrize("word", ["help", "--help", "-h"])
def test_each_help_word_is_the_help(word):
    assert read([word], CELL_OPTIONS) == "help"


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("stopp", "stop"),
        ("debgu", "debug"),
        ("pul", "pull"),
        ("statu", "status"),
        ("stack", "stacks"),
        ("STOP", "stop"),
        ("resise", "resize"),
    ],
)
def test_a_typo_names_the_command_it_is_closest_to_and_every_command(typed, meant):
    with pytest.raises(TaasUsageError) as raised:
        read([typed, "x"], CELL_OPTIONS)
    assert str(raised.value) == (
        f"%taas {typed} is not a command (did you mean %taas {meant}?): %taas takes status, stop, debug, pull, "
        "push, resize, stacks, runs, wait, cluster, version, help (%taas help says what each does)"
    )


@pytest.mark.parametrize("line", [["--gpus", "2"], ["--gpus=2"], ["--keep"], ["--profile", "--gpus", "4"]])
def test_a_cells_option_on_the_line_says_where_it_belongs(line):
    with pytest.raises(TaasUsageError) as raised:
        read(line, CELL_OPTIONS)
    option, shown = line[0].split("=")[0], " ".join(line)
    assert str(raised.value) == (
        f"{option} is an option of a taas cell, not of the line %taas: put it on the cell's first line "
        f"(%%taas {shown}, or #pragma taas {shown}); %taas help lists what the line takes"
    )


def test_an_unknown_option_on_the_line_is_named_with_the_closest_one():
    with pytest.raises(TaasUsageError, match=r"^unknown option '--kep' for the line %taas \(did you mean --keep\? "):
        read(["--kep"], CELL_OPTIONS)
    with pytest.raises(TaasUsageError, match=r"^unknown option '--hlep' for the line %taas \(did you mean --help\?\)"):
        read(["--hlep"], CELL_OPTIONS)


@given(st.lists(st.from_regex(r"\S+", fullmatch=True), max_size=4))  # words, as the line is split
def test_any_line_is_a_command_or_one_line_that_lists_the_commands(words):
    """Whatever a person types after %taas: a command, or a one-line error that says what %taas takes."""
    try:
        command = read(words, CELL_OPTIONS)
    except TaasUsageError as e:
        message = str(e)
        assert "\n" not in message
        assert message.endswith("(%taas help says what each does)") or "is an option of a taas cell" in message
        return
    assert command in (*COMMANDS, line_commands.CHECK, line_commands.SETTINGS)
    assert command != line_commands.SETTINGS or not words


def test_the_help_lists_every_command_and_every_cell_option():
    shown = help_text(CELL_OPTIONS)
    assert all(command.usage in shown for command in COMMANDS.values())
    assert all(option in shown for option in CELL_OPTIONS)
    assert help_text(CELL_OPTIONS, "pull") == f"{COMMANDS['pull'].usage}\n    {COMMANDS['pull'].does}"


def test_help_of_an_unknown_command_names_the_commands():
    assert line_commands.help_command(["stop"]) == "stop" and line_commands.help_command([]) is None
    with pytest.raises(TaasUsageError, match=r"^%taas help takes one of status, stop, .* or nothing; got 'nope'"):
        line_commands.help_command(["nope"])


def test_the_magics_own_help_lists_the_commands():
    """`%taas?` shows the magic's docstring: the commands are in it, as `%taas help` lists them."""
    assert line_commands.table() in (TaasMagics.taas.__doc__ or "")


def test_a_typo_of_a_cells_option_is_named_with_the_closest_one():
    with pytest.raises(TaasUsageError, match=r"^unknown option '--gpu' \(did you mean --gpus\?\): allowed are --gpus,"):
        options.parse(TaasMagics.taas, "--gpu 2")
