"""What a cell reads and what it binds, from its syntax tree."""

from __future__ import annotations

import ast
from typing import Any


def names_read(tree: ast.AST) -> set[str]:
    """Every name the cell loads (or declares global): candidates to take from the notebook."""
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store)}
    return read | {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}


def code_names(code: Any) -> set[str]:
    """Global and attribute names a compiled function or cell uses, nested functions included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names


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
