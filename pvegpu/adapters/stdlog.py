"""The stdlib logger adapters warn through (``pvegpu``), without importing ``logging`` before a warning needs it.

``logging`` brings ``traceback``, ``string``, ``weakref``...: about 3 ms of a reset's start-up, and a reset that
warns about nothing never needs it. The edge (``logs.configure``) asks for warnings as "warning: ..." lines on
stderr with ``to_stderr``; the handler is put in place at the first warning (or at once, if something imported
``logging`` already).
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing is not imported at run time
if TYPE_CHECKING:
    import logging

_to_stderr = False


def to_stderr() -> None:
    """From now on the logger ``pvegpu`` writes "warning: MESSAGE" lines on stderr (and only there)."""
    global _to_stderr
    _to_stderr = True
    if "logging" in sys.modules:
        _install()


def logger() -> logging.Logger:
    """The logger ``pvegpu``, with the stderr handler when ``to_stderr`` was asked for."""
    import logging

    if _to_stderr:
        _install()
    return logging.getLogger("pvegpu")


def _install() -> None:
    import logging

    log = logging.getLogger("pvegpu")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("warning: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
