"""``pvegpu`` and ``python -m pvegpu``: the gate's fast path, or the full CLI."""

from __future__ import annotations

import sys

_FULL = {"install", "uninstall", "status", "allow-once", "--help", "-h"}


def main() -> None:
    argv = sys.argv[1:]
    if argv and (argv[0] == "check" or (argv[0] == "hook" and len(argv) > 1 and argv[1] not in _FULL)):
        if "--help" not in argv and "-h" not in argv:
            from .hook import main_fast

            sys.exit(main_fast(argv))
    from .cli import run

    run()


if __name__ == "__main__":
    main()
