"""multiprocessing's folders in a rank or producer: named after it, removed with it, its workers' too."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

from taas_magic.process import tempfiles


def _in_a_child(body) -> dict:
    """Run ``body()`` in a forked process (as a rank is) and return the JSON it writes."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.write(write, json.dumps(body()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(answer)


def _worker(queue) -> None:
    from multiprocessing import util

    queue.put(util.get_temp_dir())
    signal.pause()  # killed, as the workers of a rank are: its own cleanup never runs


def test_folders_of_a_process_and_its_killed_workers_go_with_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    kernels = tmp_path / "pymp-kernel"
    kernels.mkdir()

    def rank() -> dict:
        from multiprocessing import process, util

        process.current_process()._config["tempdir"] = str(kernels)  # what the kernel had made
        tempfiles.name_multiprocessing_folders()
        queue = multiprocessing.get_context("fork").Queue()
        worker = multiprocessing.get_context("fork").Process(target=_worker, args=(queue,), daemon=True)
        worker.start()  # before this process has a folder: the worker makes one of its own
        workers = queue.get(timeout=10)
        own = util.get_temp_dir()
        before = sorted(os.listdir(tmp_path))
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        tempfiles.remove_multiprocessing_folders()
        return {
            "pid": os.getpid(),
            "own": own,
            "workers": workers,
            "before": before,
            "after": sorted(os.listdir(tmp_path)),
        }

    seen = _in_a_child(rank)
    prefix = f"pymp-taas-{seen['pid']}-"
    assert os.path.basename(seen["own"]).startswith(prefix) and os.path.basename(seen["workers"]).startswith(prefix)
    assert len(seen["before"]) == 3, "the kernel's, the rank's and its worker's"
    assert seen["after"] == ["pymp-kernel"], "the kernel's folder is the kernel's"


def test_the_reaper_removes_the_folders_of_a_killed_process(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    for name in ("pymp-taas-4242-abc", "pymp-taas-4242-def", "pymp-taas-42420-xyz", "pymp-other"):
        (tmp_path / name).mkdir()
    (tmp_path / "pymp-taas-4242-abc" / "listener-1").write_text("")
    tempfiles.remove_folders_of(4242)
    assert sorted(os.listdir(tmp_path)) == ["pymp-other", "pymp-taas-42420-xyz"]
