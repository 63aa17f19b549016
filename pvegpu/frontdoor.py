"""The one front door of ``pvegpu``: global options wherever they stand, then the gate's light path or the CLI.

Every command honours ``--config FILE`` (and the hidden ``--simulate DIR``), ``--version`` and ``-h``/``--help``,
before or after the subcommand. They are taken off the line here, by one rule, for every command; ``check``
and ``hook VMID PHASE`` then run on the import-light path (``pvegpu.hook``), ``reset`` on its own light parser
(``pvegpu.resetcmd``; typer for ``--help`` and for a line it is not sure of), everything else through typer
(``pvegpu.cli``). Errors render themselves (``PvegpuError.show``); nothing reaches the user as a traceback unless
``PVEGPU_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys

from . import __version__
from . import errors as E

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:
    pass

WITH_VALUE = ("--config", "--simulate")
_EXAMPLES = {"--config": "e.g. `pvegpu --config /etc/pvegpu/pvegpu.toml check 129`",
             "--simulate": "e.g. `pvegpu --simulate /tmp/node check 129` (a simulated node's directory: `pvegpu sim create /tmp/node`)"}
HOOK_SUBCOMMANDS = ("install", "uninstall", "status", "allow-once")


def split_globals(argv: list[str]) -> tuple[dict[str, str | bool], list[str]]:
    """Take the global options off the line (``--config X``, ``--config=X``, ``--version``); the rest stays in order."""
    found: dict[str, str | bool] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        name, eq, value = arg.partition("=")
        if name in WITH_VALUE:
            if not eq:
                if i + 1 >= len(argv):
                    raise E.UsageError(f"{name} needs a value", _EXAMPLES.get(name, f"e.g. `pvegpu {name} VALUE check 129`"))
                i += 1
                value = argv[i]
            found[name[2:]] = value
        elif arg == "--version":
            found["version"] = True
        else:
            rest.append(arg)
        i += 1
    return found, rest


def is_gate_command(rest: list[str]) -> bool:
    """``check ...`` or ``hook VMID PHASE`` (not ``hook install`` etc., not ``hook --help``)."""
    if not rest:
        return False
    if rest[0] == "check":
        return True
    return rest[0] == "hook" and len(rest) > 1 and rest[1] not in HOOK_SUBCOMMANDS and rest[1] not in ("-h", "--help")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        found, rest = split_globals(argv)
    except E.PvegpuError as exc:
        return exc.show(sys.stderr)
    if found.get("version"):
        print(f"pvegpu {__version__}")
        return E.EXIT_OK
    from .wiring import GlobalOptions

    opts = GlobalOptions(config=_str(found.get("config")), simulate=_str(found.get("simulate")))
    try:
        if is_gate_command(rest):
            from . import hook

            return hook.main(rest, opts)
        if rest and rest[0] == "reset":  # no typer/pydantic/rich: ~110 ms of a reset's start-up (pvegpu/resetcmd.py)
            from . import resetcmd

            code = resetcmd.main(rest[1:], opts)
            if code is not None:
                return code
        if rest and rest[0] == "audit":  # the same for audit: typer's start-up is as long as a scan of 2,000 processes
            from . import auditcmd

            code = auditcmd.main(rest[1:], opts)
            if code is not None:
                return code
        from . import cli

        return cli.run(rest, opts)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`pvegpu check 129 | head -1`): exit quietly, as SIGPIPE would
        return 141
    except E.PvegpuError as exc:
        return exc.show(sys.stderr)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, not a traceback
        if os.environ.get("PVEGPU_DEBUG") == "1":
            raise
        return E.PvegpuError(f"internal error: {type(exc).__name__}: {exc}",
                             "please report it with the command line; PVEGPU_DEBUG=1 shows the traceback").show(sys.stderr)


def _str(v: str | bool | None) -> str | None:
    return v if isinstance(v, str) else None
