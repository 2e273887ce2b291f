"""taas.register / unregister / registered."""

from __future__ import annotations

import gc
from unittest.mock import MagicMock

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import taas
from taas.registry import is_registered


def test_register_is_idempotent_and_unregister_removes():
    loader = DataLoader(list(range(4)))
    taas.register(loader)
    taas.register(loader)
    assert taas.registered().count(loader) == 1
    taas.unregister(loader)
    assert loader not in taas.registered()


def test_only_dataloaders_are_accepted():
    with pytest.raises(TypeError, match="accepts a torch.utils.data.DataLoader, not builtins.list"):
        taas.register([1, 2, 3])


def test_unregistering_an_unknown_loader_names_it():
    with pytest.raises(ValueError, match="DataLoader at 0x[0-9a-f]+ is not registered"):
        taas.unregister(DataLoader([1]))


def test_the_registry_does_not_keep_a_deleted_loader_alive():
    loader = DataLoader(list(range(4)))
    taas.register(loader)
    del loader
    gc.collect()
    assert taas.registered() == []


@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.floats(allow_nan=True),
        st.text(),
        st.booleans(),
        st.builds(MagicMock),
        st.builds(object),
        st.lists(st.none()),
    )
)
def test_no_value_but_a_registered_loader_is_registered(value):
    """The registry is looked up by identity: a lookup that misses must not match the value
    (None matched the miss, and every cell that read a name bound to None failed)."""
    loader = DataLoader([1])
    taas.register(loader)
    try:
        assert not is_registered(value)
        assert is_registered(loader)
        with pytest.raises(ValueError, match="is not registered"):
            taas.unregister(value)
    finally:
        taas.unregister(loader)
