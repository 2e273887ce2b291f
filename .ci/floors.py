"""The dependency floors of pyproject.toml as pip constraints: `name==floor`, one a line.

    python .ci/floors.py [EXTRA ...] > floors.txt
    pip install -c floors.txt .

Every runtime dependency (and every one of the named extras) must say `>=FLOOR`: a floor is what
`make test-min` installs and tests, so a dependency without one could not be tried at its lowest.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(?:;.*)?$")


def requirements(extras: list[str]) -> list[str]:
    """The requirement strings of the runtime dependencies and of ``extras`` (a self-reference like
    ``taas-magic[lightning]`` is followed, not listed)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    found = list(project["dependencies"])
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"floors: pyproject.toml has no extra {extra!r}: choose from {', '.join(optional)}")
        seen.add(extra)
        for requirement in optional[extra]:
            itself = re.match(rf"^{re.escape(project['name'])}\[([^\]]*)\]$", requirement.strip())
            if itself:
                pending += [name.strip() for name in itself[1].split(",")]
            else:
                found.append(requirement)
    return found


def floors(extras: list[str]) -> dict[str, str]:
    """``{name: floor}`` for the runtime dependencies and ``extras``; a requirement without a floor is an error."""
    pinned: dict[str, str] = {}
    for requirement in requirements(extras):
        match = REQUIREMENT.match(requirement)
        if match is None:
            raise SystemExit(f"floors: {requirement!r} in pyproject.toml has no '>=FLOOR': give it the lowest "
                             "version that `make test-min` passes with")
        name = re.sub(r"[-_.]+", "-", match[1]).lower()
        pinned[name] = max(pinned.get(name, match[3]), match[3], key=_numbers)
    return pinned


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


if __name__ == "__main__":
    for name, floor in floors(sys.argv[1:]).items():
        print(f"{name}=={floor}")
