"""torch's backend plugins are looked up once in the kernel, not once per rank."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from support import ROOT

SRC = str(ROOT / "src")

CHECK = textwrap.dedent("""
    import importlib.metadata, sys
    import torch.distributed as dist
    from taas_magic.rank import plugins

    scans = []
    scan = importlib.metadata.distributions
    def distributions(**kwargs):  # what every entry point look-up reads: watched
        scans.append(kwargs)
        return scan(**kwargs)
    plugins.find()
    importlib.metadata.distributions = distributions
    plugins.use()
    dist.Backend._ensure_backend_registered("gloo")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    print("scans", len(scans), dist.get_backend())
    importlib.metadata.entry_points(group="console_scripts")
    print("others", len(scans) > 0)
""")


def run(code: str, **env: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": SRC, **env},
    ).stdout


def test_torchs_look_up_of_backend_plugins_is_answered_from_the_kernels_and_others_are_not():
    assert run(CHECK).split() == ["scans", "0", "gloo", "others", "True"]


def test_a_rank_whose_packages_changed_since_lets_torch_look_itself(tmp_path):
    changed = CHECK.replace("plugins.use()", f"open({str(tmp_path / 'new')!r}, 'w').close()\nplugins.use()")
    changed = changed.replace("plugins.find()", f"sys.path.append({str(tmp_path)!r})\nplugins.find()")
    assert int(run(changed).split()[1]) > 0, "torch looked for itself"
