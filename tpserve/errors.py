"""The one typed error for configuration problems found before or during start-up.

Library code raises ``ConfigError`` (never ``SystemExit``) so the offline engine, tests and
benchmarks can catch a bad setting as an ordinary exception; ``tpserve.__main__`` alone turns
it into one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class ConfigError(ValueError):
    """A flag, checkpoint or environment that tpserve cannot serve as given.

    ``flag`` names the command-line flag to change (e.g. ``--tp-size``), when one does.
    """

    def __init__(self, message: str, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def exit_code_of(main: Callable[[], int | None]) -> int:
    """Run a command's ``main``; a ConfigError becomes one line on stderr and exit code 2.

    The one place a configuration error becomes a process exit, shared by every command
    (``python -m tpserve`` and the trainers).
    """
    try:
        return main() or 0
    except ConfigError as exc:
        # One write of the whole line: print() writes the text and the newline apart, and
        # under torchrun every rank refuses at once into the same pipe, so two ranks' lines
        # ran together ("...N)error: ...N)"). A write under PIPE_BUF bytes is not interleaved.
        sys.stderr.write(f"error: {exc}\n")
        sys.stderr.flush()
        return 2
