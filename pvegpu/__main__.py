"""``pvegpu`` and ``python -m pvegpu``: everything enters through ``frontdoor.main``."""

from __future__ import annotations

import sys


def main() -> None:
    from .frontdoor import main as front

    sys.exit(front())


if __name__ == "__main__":
    main()
