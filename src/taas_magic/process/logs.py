"""What taas's own processes log, for troubleshooting taas itself: silent unless ``TAAS_LOG`` asks.

Every module logs to ``logging.getLogger(__name__)``, under the ``taas_magic`` logger, which has no
handler of its own (the package adds a ``NullHandler``): nothing is written by default. With
``TAAS_LOG=debug`` (or ``info``, ``warning``) in the kernel's environment, each run writes one file,
``taas-logs/<run id>.log`` in the temporary folder, that every process of the run appends to: the
kernel's side of the run, the run's supervisor, the fork server, the producers, the ranks' taas
code. The ranks' environments carry the file's path (``TAAS_LOG_FILE``), which is how processes
started earlier than the run (the fork server) learn it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterator, Mapping

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
LEVEL_VARIABLE = "TAAS_LOG"
FILE_VARIABLE = "TAAS_LOG_FILE"
_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
_ROOT = "taas_magic"


def run_file(run_id: str) -> Path:
    """Where run ``run_id`` logs: one file per run, in the temporary folder."""
    return Path(tempfile.gettempdir()) / "taas-logs" / f"{run_id}.log"


def variables(level: str | None, run_id: str) -> dict[str, str]:
    """What the run's processes are told: the level and the file, when the run logs (``level``)."""
    return {} if level is None else {LEVEL_VARIABLE: level, FILE_VARIABLE: str(run_file(run_id))}


def follow(env: Mapping[str, str]) -> None:
    """In a taas process (a supervisor, the fork server, a producer): log as a run's environment
    ``env`` says, to its file; or not at all, for a run that does not log."""
    logger = logging.getLogger(_ROOT)
    for handler in [h for h in logger.handlers if getattr(h, "taas_run_log", False)]:
        logger.removeHandler(handler)
        handler.close()
    level, path = LEVELS.get(env.get(LEVEL_VARIABLE, "")), env.get(FILE_VARIABLE)
    if level is not None and path:
        logger.addHandler(_file_handler(Path(path), level))
        logger.setLevel(level)


@contextlib.contextmanager
def kernel_side(level: str | None, run_id: str) -> Iterator[Path | None]:
    """In the kernel, for one run: its log file while the run goes (None when the run does not log).
    The kernel's logging is as it was afterwards."""
    if level is None:
        yield None
        return
    path = run_file(run_id)
    handler = _file_handler(path, LEVELS[level])
    logger = logging.getLogger(_ROOT)
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(LEVELS[level])
    try:
        yield path
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
        handler.close()


def _file_handler(path: Path, level: int) -> logging.Handler:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8", delay=False)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter(_FORMAT))
    setattr(handler, "taas_run_log", True)
    os.chmod(path, 0o600)
    return handler
