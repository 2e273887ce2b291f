"""Print the options that make `uv pip install` take packages from where pip's configuration says.

The Makefile installs the environment with uv, which unpacks wheels on every core and links
them from its cache on later installs (seconds, against pip's 45 s for torch's CUDA build),
but which reads no pip configuration. A machine whose pip is pointed at local indexes, or
capped by a constraints file, is read here so that uv installs what pip would: the indexes
(pip's rule of the best match across all of them), the find-links and the constraints.

Usage: python .ci/uv_options.py PYTHON  (the Python whose pip to read; one option or value per line)
"""

from __future__ import annotations

import ast
import subprocess
import sys

# The sections `pip install` reads, later over earlier as in pip: its configuration files' [global] and
# [install] (pip has merged the files already), then PIP_* variables.
SECTIONS = ("global", "install", ":env:")


def pip_config(python: str) -> dict[str, str]:
    """pip's configured values for `pip install`, by option name."""
    listing = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    found: dict[tuple[int, str], str] = {}
    for line in listing.splitlines():
        key, _, quoted = line.partition("=")
        section, _, name = key.rpartition(".")
        if section in SECTIONS and quoted:
            found[SECTIONS.index(section), name] = ast.literal_eval(quoted)
    return {name: value for (_, name), value in sorted(found.items())}


def uv_options(config: dict[str, str]) -> list[str]:
    options = ["--index-strategy", "unsafe-best-match"]  # pip takes the best match from every index
    if "index-url" in config:
        options += ["--index-url", config["index-url"]]
    for option in ("extra-index-url", "find-links", "constraint"):
        for value in config.get(option, "").split():
            options += [f"--{option}", value]
    if config.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        options.append("--no-index")
    return options


if __name__ == "__main__":
    print("\n".join(uv_options(pip_config(sys.argv[1]))))
