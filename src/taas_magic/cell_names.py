"""What a cell reads and what it binds, from its syntax tree."""

from __future__ import annotations

import ast
import functools
import types
from typing import Any, Collection


def names_read(tree: ast.AST) -> set[str]:
    """Every name the cell loads (or declares global): candidates to take from the notebook."""
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store)}
    # `total += x` reads `total` before it binds it
    read |= {
        node.target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name)
    }
    return read | {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}


def code_names(code: Any) -> set[str]:
    """Global and attribute names a compiled function or cell uses, nested functions included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names


def names_reached(reads: Collection[str], namespace: dict[str, Any]) -> set[str]:
    """The notebook's names a cell uses: those it reads, and those the notebook's functions and
    classes it uses read in turn."""
    pending = list(reads)
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen or name not in namespace:
            continue
        seen.add(name)
        for function in _notebook_functions(namespace[name], namespace):
            pending.extend(code_names(function.__code__))
    return seen


def _notebook_functions(value: Any, namespace: dict[str, Any]) -> list[types.FunctionType]:
    """The functions defined in the notebook that ``value`` is or holds (a class's methods, a
    bound method's function, a partial's function).

    Only real functions, methods and partials are looked into, by their type: a notebook value
    may answer any attribute (a mock) or raise from every one, and is never asked for one.
    """
    if isinstance(value, type):
        try:
            candidates = list(vars(value).values())
        except TypeError:
            return []
    else:
        candidates = [value]
    found = []
    for candidate in candidates:
        if isinstance(candidate, (staticmethod, classmethod, types.MethodType)):
            candidate = candidate.__func__
        elif isinstance(candidate, functools.partial):
            candidate = candidate.func
        if isinstance(candidate, types.FunctionType) and candidate.__globals__ is namespace:
            found.append(candidate)
    return found


def top_level_bindings(tree: ast.Module) -> list[str]:
    """Names a cell binds at its top level (assignments, defs, classes, imports, loop targets…)."""
    names: dict[str, None] = {}

    class Binder(ast.NodeVisitor):
        def visit_Name(self, node: ast.Name) -> None:
            if isinstance(node.ctx, ast.Store):
                names[node.id] = None

        def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
            names[node.name] = None  # its body binds locals, not cell names

        visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

        def visit_Lambda(self, node: ast.Lambda) -> None:
            pass

        def visit_alias(self, node: ast.alias) -> None:
            if node.name != "*":
                names[(node.asname or node.name).partition(".")[0]] = None

        def visit_own_scope(self, node: ast.AST) -> None:
            pass  # comprehension variables do not leak into the cell

        visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_own_scope

    Binder().visit(tree)
    return list(names)
