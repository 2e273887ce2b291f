"""Every error a user can see from a taas cell, and the shape of its message.

    TaasUsageError (an IPython UsageError)   bad input, in one line before anything starts:
                                             "--gpus 12 does not fit g2.8 (8 GPUs per node): use 1-8, 16 or 32"
    TaasRunError                             a run that started and did not succeed; ``lines`` is what the cell shows
      ├── RankFailed                         a rank raised, exited non-zero or died by a signal:
      │                                      "rank 1 failed: <Type>: <message>", its traceback below
      ├── RunTimedOut                        "--timeout 30 s elapsed: rank 1 still running, now stopped", and its stack
      ├── RunLost                            "taas lost the run's processes (<why>); every process of the run
      │                                      was stopped"
      ├── ForkServerDied                     "the taas fork server stopped unexpectedly (<why>); the next cell
      │                                      starts a new one"
      ├── DeliveryLost                       "data delivery to the ranks of this node failed (<why>); every process ..."
      └── SessionEnded                       "the session ended: <why>", and what became of the cell
    RunInterrupted (a KeyboardInterrupt)     the cell was interrupted and every rank stopped:
                                             "KeyboardInterrupt: taas run interrupted; every rank stopped (0: ...)"

Run errors implement IPython's ``_render_traceback_`` so the cell shows the failing rank's own
traceback, not the extension's internals.
"""

from __future__ import annotations

import re

from IPython.core.error import UsageError

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # terminal colours, in the lines a cell shows


class TaasUsageError(UsageError):
    """Bad options or configuration: one line naming the value and what is allowed.

    Shown as that one line (no traceback of the extension), and still an error for the
    frontend, so "run all" stops at the cell.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31mUsageError\x1b[0m: {self}"]


class TaasRunError(RuntimeError):
    """A run started and did not succeed; ``lines`` is what the cell shows."""

    def __init__(self, message: str, lines: list[str]):
        super().__init__(message)
        self.lines = lines

    def _render_traceback_(self) -> list[str]:
        return self.lines

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled as it is, not remade from its message alone (which its ``__init__`` does not take): a
        node's agent raises it, and Ray brings it to the kernel as a pickle. Remade from ``args``, it
        reached the kernel as Ray's "Failed to deserialize exception", not as its own line."""
        return _remade, (type(self), self.args, self.__dict__)


def _remade(kind: type[BaseException], args: tuple[object, ...], state: dict[str, object]) -> BaseException:
    error = kind.__new__(kind, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class RankFailed(TaasRunError):
    """At least one rank failed; the first failure is the root cause shown.

    ``peer_errors``: what the ranks broken by that failure raised themselves (rank -> "Type: message"),
    which the cell does not show: gloo's "Connection closed by peer" says nothing the root cause does not.
    """

    def __init__(self, message: str, lines: list[str], peer_errors: dict[int, str] | None = None):
        super().__init__(message, lines)
        self.peer_errors = dict(peer_errors or {})


class RunTimedOut(TaasRunError):
    """Ranks were still running when ``--timeout`` elapsed."""


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``: enough to say why, short enough for a one-line notice
    (the type alone when the message cannot even be made: its ``__str__`` raised)."""
    try:
        text = str(error).strip().splitlines()
    except Exception:
        text = []
    return f"{type_name(error)}: {text[0]}" if text else type_name(error)


def type_name(value: object) -> str:
    """The name of ``value``'s class, even where its metaclass answers ``__name__`` with an error."""
    return str(type.__dict__["__name__"].__get__(type(value)))


class RunLost(TaasRunError):
    """The kernel lost its supervisor: it died, or its channel failed; everything of the run was ended."""

    def __init__(self, detail: str):
        message = f"taas lost the run's processes ({detail}); every process of the run was stopped"
        super().__init__(message, [message])
        self.detail = detail


class ForkServerDied(TaasRunError):
    """The fork server could not take the run: it is gone."""

    def __init__(self, detail: str):
        message = f"the taas fork server stopped unexpectedly ({detail}); the next cell starts a new one"
        super().__init__(message, [message])


class DeliveryLost(TaasRunError):
    """A node's ranks can no longer be fed: a node that hosts producers did not answer."""

    def __init__(self, detail: str):
        message = f"data delivery to the ranks of this node failed ({detail}); every process of the run was stopped"
        super().__init__(message, [message])


class SessionEnded(TaasRunError):
    """The session is over (a rank died, or did not leave an interrupted cell): nothing of it is left.

    ``why``: the reason alone ("rank 1 killed by signal SIGKILL: its process group cannot continue"), as
    ``%taas`` and a later cell say it after "the session ended: ". ``failed``: the ranks whose cell had failed
    before the session ended, which `%taas debug` names afterwards (their errors went with the session).
    """

    def __init__(self, message: str, lines: list[str], why: str = "", failed: tuple[int, ...] = ()):
        super().__init__(message, lines)
        self.why = why or message
        self.failed = failed


class ProducersGone(EOFError):
    """A rank's loader asked for more, and every producer that fed it has closed its channel: a producer
    process of the run is gone. Its ranks stop as the others do when a peer is lost."""

    def __init__(self) -> None:
        super().__init__("every producer has closed this channel")


class RunInterrupted(KeyboardInterrupt):
    """The cell was interrupted; every rank has been stopped."""

    def __init__(self, lines: list[str]):
        super().__init__(plain(lines[0]) if lines else "")  # the error's evalue: stored and shown as text
        self.lines = lines

    def _render_traceback_(self) -> list[str]:
        return self.lines

    def __reduce__(self) -> tuple[object, ...]:
        return _remade, (type(self), self.args, self.__dict__)


def plain(text: str) -> str:
    """Text without terminal colours: for an error's one-line value, which Jupyter stores as is."""
    return ANSI.sub("", text)
