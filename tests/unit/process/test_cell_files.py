"""IPython's map of cell files to numbers, read in one place for the kernel and forked ranks alike."""

from __future__ import annotations

from types import SimpleNamespace

from taas_magic.process import cell_files


def test_the_shell_s_own_map_is_returned_so_a_forked_rank_can_add_to_it():
    numbers = {"/tmp/ipykernel_1/2.py": 5}
    shell = SimpleNamespace(compile=SimpleNamespace(_filename_map=numbers))
    assert cell_files.cell_numbers(shell) is numbers
    assert cell_files.cell_labels(shell) == {"/tmp/ipykernel_1/2.py": "Cell In[5]"}


def test_no_shell_or_a_shell_without_the_map_has_no_cells():
    for shell in (None, SimpleNamespace(), SimpleNamespace(compile=SimpleNamespace(_filename_map="not a dict"))):
        assert cell_files.cell_numbers(shell) is None
        assert cell_files.cell_labels(shell) == {}
