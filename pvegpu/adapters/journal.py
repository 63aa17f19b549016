"""One line to the system log (``journalctl -t pvegpu``, or /var/log/syslog), for what an admin whose session
dropped must still find: a reset interrupted by a signal, a container left stopped.

Manual equivalent: ``logger -t pvegpu -p user.warning 'pvegpu reset of CT 129 ...'``. The line goes as one
RFC 3164 datagram to ``/dev/log`` (journald and rsyslog both listen there); no socket there: nothing is
written and nothing fails.
"""

from __future__ import annotations

import os
import socket

from pvegpu.core.safetext import escape

DEV_LOG = "/dev/log"
USER_WARNING = 8 * 1 + 4  # facility user, severity warning


def log_line(line: str, path: str | None = None) -> bool:
    """Send ``line`` (control characters escaped, at most 1 KiB) with ident ``pvegpu``; True when it was sent."""
    text = escape(line)[:1024]
    data = f"<{USER_WARNING}>pvegpu[{os.getpid()}]: {text}".encode("utf-8", "replace")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.settimeout(1.0)
            s.sendto(data, path or DEV_LOG)
        return True
    except OSError:
        return False
