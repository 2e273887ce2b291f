"""The errors a user can see from a taas cell.

    TaasUsageError (an IPython UsageError)   bad input, reported in one line before anything starts
    TaasRunError                              a run that started and did not succeed
      ├── RankFailed                          a rank raised, exited non-zero or died by a signal
      ├── RunTimedOut                         --timeout elapsed; shows where each rank was
      └── (interrupts end the cell with the ordinary KeyboardInterrupt)

Run errors implement IPython's ``_render_traceback_`` so the cell shows the failing rank's own
traceback, not the extension's internals.
"""

from __future__ import annotations

from IPython.core.error import UsageError


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


class RankFailed(TaasRunError):
    """At least one rank failed; the first failure is the root cause shown."""


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
