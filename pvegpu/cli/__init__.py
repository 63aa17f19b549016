"""The command line. ``run(argv)`` is ``pvegpu``: two ways in, one error rendering.

``pvegpu hook VMID PHASE`` is PVE's calling convention for a hookscript (the guard,
``contrib/hookscripts/pvegpu-guard``, runs it inside every container start): its two words are read from ``argv``
here and handed to ``hook``, which needs neither typer, proxmoxer nor structlog; its settings come from
``PVEGPU_CONFIG`` (default ``/etc/pvegpu/pvegpu.toml``) and, on a simulated node, ``PVEGPU_SIMULATE``. Every
other line is a human command, parsed by the typer app (``app``), global options included; ``reset`` and
``audit`` hold those commands' bodies, ``render`` their text, ``install`` the guard's installer.
"""

from __future__ import annotations

import os
import sys

from pvegpu.cli import hook
from pvegpu.core import errors as E


def is_hook_call(argv: list[str]) -> bool:
    """``hook VMID PHASE`` as PVE calls it, or a malformed call the hook explains (``hook 12x pre-start``, ``hook -1
    pre-start``): ``hook`` then a word starting with a digit (or a minus and a digit: a vmid, never an option), no
    help asked. ``hook install`` (or ``hook instal``) is a human command."""
    return (len(argv) > 1 and argv[0] == "hook" and argv[1].removeprefix("-")[:1].isdigit()
            and not {"-h", "--help"} & set(argv))


def run(argv: list[str]) -> int:
    """The exit code of ``pvegpu ARGV``; whatever goes wrong is one rendered error, never a traceback (unless
    ``PVEGPU_DEBUG=1``)."""
    try:
        if is_hook_call(argv):
            return hook.main(argv[1:])
        from pvegpu.cli import app as cli  # typer: never on the hookscript's path

        return cli.main(argv)
    except KeyboardInterrupt:
        return E.SignalledError("interrupted", None, 130).show(sys.stderr)
    except BrokenPipeError:  # the reader went away (`pvegpu audit | head -1`): exit quietly, as SIGPIPE would
        return 141
    except E.PvegpuError as exc:
        return exc.show(sys.stderr)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, not a traceback
        if os.environ.get("PVEGPU_DEBUG") == "1":
            raise
        return E.internal(exc).show(sys.stderr)
