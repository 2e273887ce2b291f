"""The layout's rules that import-linter does not check: modules keep their private names to themselves.

``lint-imports`` (in ``make test``) checks the layers and independence in pyproject.toml; these check the
rest of what docs/architecture.md promises about the code's shape.
"""

from __future__ import annotations

import ast
import re

from support import ROOT

SRC = ROOT / "src"
PACKAGES = ("taas_magic", "taas")


def modules() -> list[tuple[str, ast.Module]]:
    found = []
    for package in PACKAGES:
        for path in sorted((SRC / package).rglob("*.py")):
            name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
            found.append((name, ast.parse(path.read_text(), str(path))))
    return found


def our_module(name: str | None) -> bool:
    return name is not None and name.split(".")[0] in PACKAGES


def test_no_private_name_is_imported_from_another_module() -> None:
    crossings = []
    for name, tree in modules():
        imported_modules: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and our_module(node.module):
                assert node.level == 0, f"{name}: relative import from {node.module}"
                for alias in node.names:
                    if alias.name.startswith("_"):
                        crossings.append(f"{name} imports {alias.name} from {node.module}")
                    imported_modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if our_module(alias.name):
                        imported_modules.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in imported_modules
            ):
                crossings.append(f"{name} reads {node.value.id}.{node.attr}")
    assert crossings == []


def test_every_package_says_what_runs_it() -> None:
    """A package's docstring says which process runs its modules: the point of the layout."""
    for name, tree in modules():
        if name.count(".") and (SRC / name.replace(".", "/") / "__init__.py").exists():
            assert ast.get_docstring(tree), f"{name} has no docstring"


def test_the_layout_is_the_one_the_docs_draw() -> None:
    architecture = (SRC.parent / "docs" / "architecture.md").read_text()
    packages = sorted(
        name
        for name, _ in modules()
        if name.count(".") == 1
        and name.startswith("taas_magic.")
        and (SRC / name.replace(".", "/") / "__init__.py").exists()
    )
    assert packages, "no subpackages found"
    for package in packages:
        assert f"{package.split('.')[1]}/" in architecture, f"docs/architecture.md does not show {package}"


def test_the_docs_name_every_module_and_no_other() -> None:
    """docs/architecture.md's "One module, one job" table has a row for each module of the tree, and only for them."""
    architecture = (SRC.parent / "docs" / "architecture.md").read_text()
    table = architecture.split("## One module, one job", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([^`]+\.py)`", table, re.MULTILINE))
    tree = {
        "taas_magic/__init__.py" if path == SRC / "taas_magic" / "__init__.py" else _shown_as(path)
        for package in PACKAGES
        for path in (SRC / package).rglob("*.py")
    }
    assert sorted(tree - rows) == [], "modules without a row"
    assert sorted(rows - tree) == [], "rows without a module"


def _shown_as(path) -> str:
    """A module as the table names it: under taas_magic/ without the package's name, taas's with it."""
    relative = path.relative_to(SRC)
    return str(relative.relative_to("taas_magic")) if relative.parts[0] == "taas_magic" else str(relative)
