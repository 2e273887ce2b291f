"""The notebook's own names for the functions ranks replace, found without walking the namespace in Python."""

from __future__ import annotations

import torch
import torch.distributed as dist

from taas_magic.rank import aliases


def test_every_name_bound_to_a_replaced_function_is_found_and_nothing_else():
    namespace = {f"n{i}": i for i in range(1000)}
    namespace.update(save=torch.save, keep=torch.save, init=dist.init_process_group, load=torch.load, t=torch.ones(1))
    assert sorted(aliases.find(namespace)) == ["init", "keep", "save"]
    assert aliases.find({"x": 1, "load": torch.load}) == ()


def test_rebind_replaces_only_the_names_given():
    namespace = {"save": torch.save, "other": torch.save}
    aliases.rebind(namespace, ("save",), torch.save, print)
    assert namespace == {"save": print, "other": torch.save}
