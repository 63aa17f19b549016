"""structlog set-up for the CLI (the only place that configures logging)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure(*, verbose: bool, json_lines: bool) -> Any:
    level = logging.DEBUG if verbose else (logging.INFO if json_lines else logging.WARNING)
    renderer: Any = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger("pvegpu")
