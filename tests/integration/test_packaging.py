"""What an installed taas-magic is: its version, where it shows, the floors of its dependencies, the files its
wheel must carry, and how it behaves without an optional extra.

The wheel itself, installed in a fresh environment and driven through a kernel, is `make wheel-check`
(.ci/wheel_check.py): it takes minutes, so it runs in CI after the test suite rather than in it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import ROOT
from traitlets.config import Config

import taas_magic
from taas_magic.kernel.settings import Defaults
from taas_magic.version import VERSION

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _ci_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / ".ci" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_version_is_written_once_and_read_by_the_build() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    assert taas_magic.__version__ == VERSION
    assert "version" not in PYPROJECT["project"] and PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "taas_magic.version.VERSION"}


def test_percent_taas_shows_the_version_on_its_first_line() -> None:
    defaults = Defaults.of(None, "all", "auto", True, 120.0, Config())
    shown = defaults.describe(SimpleNamespace(describe=lambda: "not started"), None, object(), None)  # type: ignore[arg-type]
    assert shown.splitlines()[0] == f"taas-magic:          {VERSION}"
    assert shown.splitlines()[1].index("fork") == shown.splitlines()[0].index(VERSION), "values in one column"


def test_the_changelog_opens_with_this_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## (\d+\.\d+\.\d+)\b", changelog, re.M)
    assert versions and versions[0] == VERSION, "a new version needs its entry in CHANGELOG.md"


def test_every_runtime_dependency_has_a_floor_that_make_test_min_installs() -> None:
    floors = _ci_module("floors").floors([])
    names = {re.match(r"[A-Za-z0-9._-]+", r)[0].lower().replace("_", "-") for r in PYPROJECT["project"]["dependencies"]}
    assert set(floors) == names
    assert floors["torch"] and floors["ipython"] and floors["ipykernel"]
    with_extras = _ci_module("floors").floors(["examples"])  # taas-magic[lightning] inside it is followed
    assert "pytorch-lightning" in with_extras and "torchvision" in with_extras


def test_a_dependency_without_a_floor_is_refused(tmp_path: Path) -> None:
    floors = _ci_module("floors")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["torch"]\n')
    floors.ROOT = tmp_path
    with pytest.raises(SystemExit, match="'torch' in pyproject.toml has no '>=FLOOR'"):
        floors.floors([])


def test_every_file_the_packages_read_is_package_data() -> None:
    """A data file added beside the code but not to [tool.setuptools.package-data] is missing from the
    wheel, and only an installed copy notices: listed here, it fails at once."""
    listed = PYPROJECT["tool"]["setuptools"]["package-data"]
    for package in ("taas_magic", "taas"):
        here = ROOT / "src" / package
        data = {
            str(p.relative_to(here))
            for p in here.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
        }
        assert data == set(listed[package]), f"src/{package}: data files {sorted(data)}, package-data {listed[package]}"


def test_the_optional_extras_say_what_they_add() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert [r.split(">=")[0] for r in extras["ray"]] == ["ray"]
    assert [r.split(">=")[0] for r in extras["lightning"]] == ["pytorch-lightning"]
    assert not any(
        r.split(">=")[0].split("[")[0] in ("ray", "pytorch-lightning", "torchvision", "tqdm")
        for r in PYPROJECT["project"]["dependencies"]
    ), "an optional package became required"


# Imports every module of both packages with the optional packages made unimportable, as in an
# environment where the extras were never installed, then uses each feature that needs one.
WITHOUT_EXTRAS = textwrap.dedent("""
    import importlib, pkgutil, sys

    OPTIONAL = {"ray", "pytorch_lightning", "lightning", "lightning_fabric", "torchvision", "tqdm", "accelerate"}

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in OPTIONAL:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Absent())
    import taas, taas_magic
    for package in (taas, taas_magic):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(module.name)
    assert not OPTIONAL & {name.split(".")[0] for name in sys.modules}, "an optional package was imported"

    from taas_magic.errors import TaasUsageError
    from taas_magic.launch.cluster.connection import ray_module
    from taas_magic.local_cluster import LocalCluster
    for use in (ray_module, lambda: LocalCluster({"c1.4": 1})):
        try:
            use()
        except TaasUsageError as e:
            print("MESSAGE", e)
        else:
            raise SystemExit("a feature that needs Ray ran without it")
""")


def test_without_an_optional_extra_everything_imports_and_its_features_say_what_to_install() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    messages = [line.removeprefix("MESSAGE ") for line in done.stdout.splitlines() if line.startswith("MESSAGE ")]
    assert len(messages) == 2
    for message in messages:
        assert "\n" not in message and message.endswith("pip install 'taas-magic[ray]'"), message


def test_the_install_takes_packages_from_where_pip_is_configured_to(tmp_path: Path) -> None:
    """make's install runs uv, which reads no pip configuration: .ci/uv_options.py hands it pip's, read from
    pip itself, with pip's precedence (a PIP_* variable over [install] over [global])."""
    config = tmp_path / "pip.conf"
    config.write_text(
        "[global]\nindex-url = https://mirror.example/simple\nfind-links = /wheels/global\n"
        "extra-index-url =\n    file:///one/simple\n    file:///two/simple\n"
        "[install]\nfind-links = /wheels/install\nconstraint = /caps.txt\n[download]\nno-index = true\n"
    )
    environment = {"PATH": os.environ.get("PATH", ""), "PIP_CONFIG_FILE": str(config), "HOME": str(tmp_path)}
    uv_options = _ci_module("uv_options")
    read = lambda **extra: subprocess.run(  # noqa: E731
        [sys.executable, str(ROOT / ".ci" / "uv_options.py"), sys.executable],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**environment, **extra},
    ).stdout.split()
    assert read() == [
        *("--index-strategy", "unsafe-best-match", "--index-url", "https://mirror.example/simple"),
        *("--extra-index-url", "file:///one/simple", "--extra-index-url", "file:///two/simple"),
        *("--find-links", "/wheels/install", "--constraint", "/caps.txt"),
    ], "[download]'s no-index is not pip install's"
    assert read(PIP_FIND_LINKS="/wheels/env /more", PIP_NO_INDEX="yes")[-7:] == [
        *("--find-links", "/wheels/env", "--find-links", "/more", "--constraint", "/caps.txt", "--no-index"),
    ]
    assert uv_options.uv_options({}) == ["--index-strategy", "unsafe-best-match"], "nothing configured: uv's own"
