"""Code objects cross between processes whole: a rank's traceback finds the cell by their file name."""

from __future__ import annotations

import pickle

from taas_magic.wire import pickler


def test_a_function_keeps_its_file_name_and_lines():
    namespace: dict = {}
    exec(compile("def double(x):\n\n    return 2 * x\n", "/tmp/ipykernel_1/123.py", "exec"), namespace)
    double = pickle.loads(pickler.dumps(namespace["double"]))
    assert double(21) == 42
    assert double.__code__.co_filename == "/tmp/ipykernel_1/123.py"
    assert double.__code__.co_firstlineno == 1 and list(double.__code__.co_lines())[-1][2] == 3


def test_a_cells_code_object_keeps_its_file_name():
    code = compile("x = 1\nraise ValueError(x)\n", "/tmp/ipykernel_1/456.py", "exec")
    assert pickle.loads(pickler.dumps(code)).co_filename == "/tmp/ipykernel_1/456.py"
