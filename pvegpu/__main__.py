"""``pvegpu`` and ``python -m pvegpu``: ``pvegpu.cli.run``, then an exit that waits for nothing."""

from __future__ import annotations

import os
import sys

from pvegpu.cli import run


def main() -> None:
    code = run(sys.argv[1:])
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # the reader went away (a closed pipe): nothing more to say to it
        pass
    # all output is flushed and every lock is an fd: nothing is left for the interpreter's teardown, and a thread
    # still inside a hung driver call (NVML) cannot hold the exit of a gate that has given its answer
    os._exit(code)


if __name__ == "__main__":
    main()
