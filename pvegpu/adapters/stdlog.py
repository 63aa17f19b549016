"""The stdlib logger adapters warn through (``pvegpu``).

The edge (``logs.configure``) asks for its warnings as "warning: ..." lines on stderr with ``to_stderr``.
"""

from __future__ import annotations

import logging
import sys

_LOG = logging.getLogger("pvegpu")


def to_stderr() -> None:
    """From now on the logger ``pvegpu`` writes "warning: MESSAGE" lines on stderr (and only there)."""
    if not _LOG.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("warning: %(message)s"))
        _LOG.addHandler(handler)
        _LOG.propagate = False


def logger() -> logging.Logger:
    """The logger ``pvegpu``."""
    return _LOG
