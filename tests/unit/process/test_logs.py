"""taas's own log: silent by default; with TAAS_LOG, one file per run that every process appends to."""

from __future__ import annotations

import logging
import os

import pytest

from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header.spec import log_level
from taas_magic.process import logs


@pytest.fixture(autouse=True)
def _temporary_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    yield
    logs.follow({})  # no handler of a test's left behind


def test_the_level_is_one_of_three_or_none_and_anything_else_is_a_one_line_error():
    assert log_level({}) is None and log_level({"TAAS_LOG": ""}) is None
    assert log_level({"TAAS_LOG": " DEBUG "}) == "debug" and log_level({"TAAS_LOG": "warning"}) == "warning"
    with pytest.raises(TaasUsageError, match=r"^TAAS_LOG='loud' is not allowed: use debug, info, warning, or leave it"):
        log_level({"TAAS_LOG": "loud"})


def test_a_run_that_logs_tells_its_processes_the_level_and_one_file_of_its_own():
    assert logs.variables(None, "abc") == {}
    told = logs.variables("info", "abc")
    assert told["TAAS_LOG"] == "info" and told["TAAS_LOG_FILE"].endswith(os.path.join("taas-logs", "abc.log"))


def test_a_process_follows_the_runs_log_and_stops_for_a_run_without_one():
    first, second = logs.variables("debug", "one"), logs.variables("info", "two")
    logs.follow(first)
    logging.getLogger("taas_magic.some.module").debug("hello %s", "one")
    logs.follow(second)  # the fork server's next run: its own file, its own level
    logging.getLogger("taas_magic.other").debug("not at info")
    logging.getLogger("taas_magic.other").info("hello two")
    logs.follow({})
    logging.getLogger("taas_magic.other").warning("nowhere")
    one, two = open(first["TAAS_LOG_FILE"]).read(), open(second["TAAS_LOG_FILE"]).read()
    assert "taas_magic.some.module DEBUG hello one" in one and "hello two" not in one
    assert "hello two" in two and "not at info" not in two and "nowhere" not in one + two
    assert f" {os.getpid()} " in one, "each line says which process wrote it"
    assert oct(os.stat(first["TAAS_LOG_FILE"]).st_mode & 0o777) == "0o600"


def test_the_kernels_side_logs_for_the_run_alone_and_is_silent_without_taas_log(caplog):
    logger = logging.getLogger("taas_magic")
    handlers, level = list(logger.handlers), logger.level
    with logs.kernel_side(None, "quiet") as path:
        assert path is None and logger.handlers == handlers
    with logs.kernel_side("debug", "loud") as path:
        logging.getLogger("taas_magic.kernel.running.controller").debug("run loud")
    assert path is not None and "run loud" in path.read_text()
    assert logger.handlers == handlers and logger.level == level, "the kernel's logging as it was"


def test_the_package_writes_nothing_by_default():
    import taas_magic  # noqa: F401  (it gives its logger a NullHandler)

    logger = logging.getLogger("taas_magic")
    assert any(isinstance(handler, logging.NullHandler) for handler in logger.handlers)
    assert not [h for h in logger.handlers if not isinstance(h, logging.NullHandler)], "nothing written by default"
