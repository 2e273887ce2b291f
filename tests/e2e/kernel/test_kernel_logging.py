"""TAAS_LOG in a real kernel: one file per run, written by the kernel, the supervisor and the fork server."""

from __future__ import annotations

import re
from pathlib import Path

from support.kernel import Kernel


def log_file(stderr: str) -> Path:
    found = re.search(r"taas: TAAS_LOG=debug: this (?:run|session)'s log is (\S+)", stderr)
    assert found, stderr
    return Path(found.group(1))


def test_taas_log_names_one_file_per_run_that_the_runs_processes_append_to(tmp_path):
    kernel = Kernel(extra_env={"TAAS_LOG": "debug", "TMPDIR": str(tmp_path)}, warm_fork_server=False)
    try:
        fork = kernel.execute("#pragma taas --gpus 2 --start fork\nprint('hi')").ok()
        text = log_file(fork.stderr).read_text()
        assert "taas_magic.kernel.running.controller INFO run " in text and "2 ranks on cpu, fork" in text
        assert "taas_magic.launch.supervisor.main INFO supervisor of run" in text
        assert re.search(r"supervisor\.ranks INFO 0 exited: 0", text) and "closed; exit statuses" in text
        served = kernel.execute("#pragma taas --gpus 2 --start forkserver\nprint('hi')").ok()
        path = log_file(served.stderr)
        assert path != log_file(fork.stderr), "a file per run"
        assert "taas_magic.launch.forkserver.server DEBUG run " in path.read_text()
        session = kernel.execute("#pragma taas --gpus 2 --keep --return none\nx = 1").ok()
        assert "supervisor of run" in log_file(session.stderr).read_text()
        kernel.execute("%taas stop").ok()
        assert oct(path.stat().st_mode & 0o777) == "0o600"
    finally:
        kernel.shutdown()


def test_without_taas_log_nothing_is_written(tmp_path):
    kernel = Kernel(extra_env={"TMPDIR": str(tmp_path)}, warm_fork_server=False)
    try:
        result = kernel.execute("#pragma taas --gpus 2\nprint('hi')").ok()
        assert "TAAS_LOG" not in result.stderr and not (tmp_path / "taas-logs").exists()
        bad = kernel.execute("%env TAAS_LOG=loud\n")
        bad = kernel.execute("#pragma taas --gpus 2\nprint('hi')")
        assert bad.error is not None and "TAAS_LOG='loud' is not allowed" in bad.error["evalue"]
    finally:
        kernel.shutdown()
