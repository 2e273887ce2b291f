"""Registered DataLoaders: the loaders a taas cell serves from CPU prefetch workers.

The registry holds weak references only: deleting a loader in the notebook unregisters it.
Outside a taas cell a registered loader is untouched and behaves exactly as before.
"""

from __future__ import annotations

import weakref
from typing import Any

_loaders: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def register(loader: Any) -> None:
    """Serve ``loader`` from prefetch workers in taas cells that use it; registering twice is harmless."""
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"taas.register accepts a torch.utils.data.DataLoader, not {type(loader).__module__}."
            f"{type(loader).__qualname__}"
        )
    _loaders[id(loader)] = loader


def unregister(loader: Any) -> None:
    """Stop serving ``loader``; raises ValueError if it was not registered."""
    if not is_registered(loader):
        raise ValueError(f"{_describe(loader)} is not registered; registered: {_describe_all()}")
    del _loaders[id(loader)]


def registered() -> list[Any]:
    """The registered loaders that still exist, in the order they were registered."""
    return list(_loaders.values())


def is_registered(obj: Any) -> bool:
    """Whether ``obj`` itself is registered. Looked up by identity, and the lookup's miss must not
    match: a missing entry reads as a sentinel that no notebook value can be (``None`` is one)."""
    return _loaders.get(id(obj), _MISSING) is obj


_MISSING = object()


def _describe(obj: Any) -> str:
    """The notebook's name for ``obj`` where there is one, else its type and address."""
    names = _notebook_names(obj)
    return f"{' = '.join(names)} ({type(obj).__qualname__})" if names else f"{type(obj).__qualname__} at {id(obj):#x}"


def _describe_all() -> str:
    return ", ".join(_describe(loader) for loader in _loaders.values()) or "none"


def _notebook_names(obj: Any) -> list[str]:
    try:
        from IPython import get_ipython
    except ImportError:
        return []
    shell = get_ipython()
    if shell is None:
        return []
    return sorted(name for name, value in shell.user_ns.items() if value is obj and not name.startswith("_"))
