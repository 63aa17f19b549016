"""Logging set-up for the CLI (the only place that configures it).

With ``-v`` or ``--json`` every reset event goes through structlog (console lines, or JSON lines on stderr).
Without them only warnings are shown, as one line each, and structlog is not imported (a run without ``-v`` or
``--json`` has no use for it). Adapters warn through the stdlib ``logging`` logger ``pvegpu`` (``adapters.stdlog``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from pvegpu.adapters import stdlog


class WarningsOnly:
    """The default EventLog: info and debug events are dropped, warnings are one line on stderr."""

    def info(self, event: str, **kw: Any) -> None:
        return None

    debug = info

    def warning(self, event: str, **kw: Any) -> None:
        _write(sys.stderr, f"warning: {event} " + " ".join(f"{k}={v!r}" for k, v in kw.items()) + "\n")


def _write(stream: Any, text: str) -> None:
    """Write and flush, ignoring a stream that fails (the session dropped: EIO; a closed pipe: EPIPE): the event
    log is information, and a reset must finish (and report) whatever happens to the terminal."""
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):  # ValueError: the stream was closed
        pass


class QuietPrintLogger:
    """structlog's final logger: one rendered line per event on ``file`` (stderr when None, looked up at each
    write), never raising when the write fails (structlog's own PrintLogger passes the OSError on)."""

    def __init__(self, file: Any = None) -> None:
        self._file = file

    def msg(self, message: str) -> None:
        _write(self._file if self._file is not None else sys.stderr, message + "\n")

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


def configure(*, verbose: bool, json_lines: bool) -> Any:
    stdlog.to_stderr()
    if not verbose and not json_lines:
        return WarningsOnly()
    import structlog  # only with -v or --json: the one path that writes events

    level = logging.DEBUG if verbose and not json_lines else logging.INFO
    renderer: Any = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *_: QuietPrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger("pvegpu")
