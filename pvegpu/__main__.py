"""``pvegpu`` and ``python -m pvegpu``: everything enters through ``frontdoor.main``."""

from __future__ import annotations

import os
import sys


def main() -> None:
    from .frontdoor import main as front

    code = front()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # the reader went away (a closed pipe): nothing more to say to it
        pass
    os._exit(code)  # all output is flushed and every lock is an fd: skip the interpreter's teardown (~20-40 ms)


if __name__ == "__main__":
    main()
