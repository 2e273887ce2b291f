"""Ordinary notebook values, as source a kernel runs: what people bind to names, for the tests
that cross the boundary between the notebook and the ranks with each of them.

``SETUP`` defines the few classes and functions the values need (in the notebook, as a user
would); ``KINDS`` maps a short name to an expression; ``values()`` is a hypothesis strategy of
expressions, these and containers of them.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

SETUP = '''
import collections, dataclasses, datetime, decimal, enum, fractions, functools, math, pathlib, re, types
import numpy as np, torch
from unittest.mock import MagicMock

class Anything:
    """Answers every attribute."""
    def __getattr__(self, name):
        return 42

class Raising:
    """Raises from every attribute it lacks."""
    def __getattr__(self, name):
        raise RuntimeError(f"no attribute {name} here")

class BadEq:
    """Cannot be compared."""
    def __eq__(self, other):
        raise RuntimeError("no comparing")
    __hash__ = object.__hash__

class Color(enum.Enum):
    RED = 1

@dataclasses.dataclass
class Point:
    x: int
    y: float

def counting():
    yield 1

def noted(tensor):
    """A tensor with an attribute of the notebook's."""
    tensor.note = None
    return tensor
'''

# Tensors that are more than their elements, or show them through a lazy view: each must arrive as it was.
TENSORS = {
    "strided_view": "torch.arange(12.0).reshape(3, 4)[:, 1::2]",
    "transposed": "torch.arange(6).reshape(2, 3).t()",
    "expanded": "torch.ones(2, 1).expand(2, 3)",
    "channels_last": "torch.arange(24.0).reshape(1, 2, 3, 4).to(memory_format=torch.channels_last)",
    "conjugate": "torch.complex(torch.arange(3.0), torch.ones(3)).conj()",
    "negative": "torch.complex(torch.arange(3.0), torch.ones(3)).conj().imag",
    "quantized": "torch.quantize_per_tensor(torch.arange(4.0), 0.5, 3, torch.quint8)",
    "sparse": "torch.eye(3).to_sparse()",
    "meta": "torch.empty(2, 3, device='meta')",
    "complex32": "torch.arange(4.0).to(torch.complex32)",
    "bfloat16": "torch.arange(5.0).to(torch.bfloat16)",
    "bool": "torch.tensor([True, False])",
    "noted": "noted(torch.ones(2))",
}

# What torch says as it makes or rebuilds two of them (a quantized tensor: deprecated; complex32: experimental),
# heard in the tests that send them: a module that sends TENSORS says `pytestmark = TORCH_WARNINGS_OF_TENSORS`.
TORCH_WARNINGS_OF_TENSORS = [
    pytest.mark.filterwarnings(f"ignore:{start}:UserWarning")
    for start in ("torch.quantize_per_tensor", "TypedStorage is deprecated", "ComplexHalf support is experimental")
]

KINDS = {
    "none": "None",
    "zero": "0",
    "false": "False",
    "true": "True",
    "empty_str": "''",
    "empty_bytes": "b''",
    "bytes": "b'\\x00\\xff'",
    "huge_int": "10**400",
    "negative_zero": "-0.0",
    "nan": "float('nan')",
    "inf": "float('-inf')",
    "complex_nan": "complex(float('nan'), 1)",
    "ellipsis": "...",
    "not_implemented": "NotImplemented",
    "empty_list": "[]",
    "empty_dict": "{}",
    "empty_tuple": "()",
    "empty_set": "set()",
    "frozenset": "frozenset({0})",
    "range": "range(0)",
    "numpy_array": "np.arange(3)",
    "numpy_empty": "np.array([])",
    "numpy_scalar": "np.float32(1.5)",
    "numpy_nan": "np.float64('nan')",
    "numpy_bool": "np.bool_(False)",
    "tensor_0d": "torch.tensor(3.0)",
    "tensor_nan": "torch.tensor(float('nan'))",
    "tensor_empty": "torch.empty(0)",
    "tensor_grad": "torch.zeros(2, requires_grad=True)",
    "parameter": "torch.nn.Parameter(torch.ones(1))",
    **{f"tensor_{kind}": expression for kind, expression in TENSORS.items()},
    "module": "torch.nn.Linear(2, 1)",
    "mock": "MagicMock()",
    "anything": "Anything()",
    "raising": "Raising()",
    "bad_eq": "BadEq()",
    "enum": "Color.RED",
    "dataclass": "Point(1, float('nan'))",
    "partial": "functools.partial(int, base=2)",
    "namespace": "types.SimpleNamespace(a=None)",
    "python_module": "math",
    "a_class": "Point",
    "a_type": "type(None)",
    "function": "lambda: None",
    "builtin": "len",
    "fraction": "fractions.Fraction(1, 3)",
    "decimal": "decimal.Decimal('NaN')",
    "date": "datetime.date(2020, 1, 1)",
    "path": "pathlib.Path('.')",
    "pattern": "re.compile('a+')",
    "deque": "collections.deque([None])",
    "counter": "collections.Counter()",
    "nested": "[None, {None: None}, (float('nan'),), {0: [MagicMock()]}]",
    "generator": "counting()",
}


def values() -> st.SearchStrategy[str]:
    """An expression for a notebook value: one of ``KINDS``, or a small container of them."""
    leaves = st.sampled_from(sorted(KINDS)).map(KINDS.__getitem__)
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3).map(lambda items: "[" + ", ".join(items) + "]"),
            st.lists(inner, max_size=3).map(lambda items: "(" + "".join(f"{item}, " for item in items) + ")"),
            st.dictionaries(st.sampled_from(["'a'", "0", "None", "''"]), inner, max_size=3).map(
                lambda items: "{" + ", ".join(f"{key}: {value}" for key, value in items.items()) + "}"
            ),
        ),
        max_leaves=4,
    )


def unpicklable(expression: str) -> bool:
    """Whether the value cannot be pickled (a generator, or holds one): ranks that do not share
    the kernel's memory may refuse it, in one line that names it."""
    return "counting()" in expression


def tensor(kind: str):
    """The tensor ``TENSORS[kind]`` makes, in a namespace of ``SETUP``'s."""
    namespace: dict = {}
    exec(SETUP, namespace)
    return eval(TENSORS[kind], namespace)


def same_tensor(sent, arrived) -> bool:
    """Whether ``arrived`` is ``sent`` as another process holds it: its type, dtype, shape, layout, device,
    quantization, attributes and elements (not whether a conjugation or negation is still a lazy view)."""
    import torch

    def described(t):
        return type(t), t.dtype, t.shape, t.layout, t.device, t.requires_grad, t.is_quantized, sorted(vars(t))

    if described(sent) != described(arrived):
        return False
    if sent.device.type == "meta":
        return True
    if sent.is_quantized:
        same_scale = (sent.q_scale(), sent.q_zero_point()) == (arrived.q_scale(), arrived.q_zero_point())
        return same_scale and torch.equal(sent.int_repr(), arrived.int_repr())
    if sent.layout != torch.strided:
        sent, arrived = sent.to_dense(), arrived.to_dense()
    if sent.dtype == torch.complex32:  # torch compares no complex32: compare its bits
        sent, arrived = sent.contiguous().view(torch.int32), arrived.contiguous().view(torch.int32)
    return torch.equal(sent.resolve_conj().resolve_neg(), arrived.resolve_conj().resolve_neg())
