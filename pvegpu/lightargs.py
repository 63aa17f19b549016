"""The light parsers' one scan of a command line (``resetcmd.parse``, ``auditcmd.parse``): options by their table.

Each command's option table also builds its typer command; the light parser only takes the lines it is sure of and
hands anything else to typer (which then says what is wrong exactly as before). This is the part they share: words
split into options with their texts and positional words, or None when unsure (an unknown option, ``--``, a flag
given ``=value``, a value missing, a value given as the next word that starts with ``-``: click would take it, too
close to a mistake to guess). Converting the texts is each command's own rule.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any


def scan(args: list[str], by_decl: Mapping[str, Any]) -> tuple[list[tuple[Any, str | None]], list[str]] | None:
    """``([(option, text or None for a flag), ...], words)`` in the order given, or None (typer decides).
    ``by_decl``: each declaration as typed (``--dry-run``, ``-v``) -> its option, which has a ``kind``."""
    given: list[tuple[Any, str | None]] = []
    words: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-") or arg == "-":
            words.append(arg)
            continue
        name, eq, text = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        opt = by_decl.get(name)
        if opt is None:
            return None
        if opt.kind == "flag":
            if eq:
                return None
            given.append((opt, None))
            continue
        if not eq:
            if i >= len(args) or args[i].startswith("-"):
                return None
            text = args[i]
            i += 1
        given.append((opt, text))
    return given, words
