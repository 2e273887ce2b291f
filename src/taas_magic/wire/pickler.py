"""cloudpickle, with code objects kept whole: their file names are how a rank's traceback finds the cell.

cloudpickle (3.1.3 and later) replaces the file name of every code object it pickles with
``<dynamic-code>``, so that payloads do not depend on where a function was defined. A rank's
traceback needs that name: it is how IPython's ``Cell In[5]`` and the cell's lines are found.
Code objects go as ``marshal`` writes them into ``.pyc`` files instead, whole; the processes of a
run share the kernel's Python, so they read them back as written.
"""

from __future__ import annotations

import io
import marshal
import pickle
from types import CodeType
from typing import Any

import cloudpickle

from taas_magic.errors import first_line


class Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is CodeType:
            try:
                return marshal.loads, (marshal.dumps(obj),)
            except ValueError:  # a constant marshal cannot write: as cloudpickle does it
                pass
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    file = io.BytesIO()
    Pickler(file, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return file.getvalue()


def same(value: Any) -> Any:
    """A reduction's rebuild that is the value itself: ``return same, (replacement,)`` pickles ``replacement``
    in an object's place (a CPU copy of a GPU tensor, a module without its hooks)."""
    return value


class Unpicklable(Exception):
    """Pickling a value raised; ``why`` is that error in one line (``Type: first line``)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def dump(pickler: pickle.Pickler, value: Any) -> None:
    """``pickler.dump(value)``, where whatever a ``__reduce__`` raises (SystemExit and RecursionError too)
    but an interrupt becomes ``Unpicklable``: the one rule of what counts as "cannot be pickled"."""
    try:
        pickler.dump(value)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise Unpicklable(first_line(e)) from None
