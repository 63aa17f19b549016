"""The man page and the bash completion of ``pvegpu``, generated from the CLI itself (one source: the typer app).

Run by ``packaging/build-deb`` with the package's own interpreter::

    python3 packaging/clidoc.py man OUT.1 [README.md]
    python3 packaging/clidoc.py completion OUT

Every command, argument and option comes from the click tree, the global options from the app's callback; only
``hook VMID PHASE`` (PVE's call of the guard, read from argv before typer) is added here.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
from dataclasses import dataclass, field

HELP = ("-h, --help", None, "show the help of the command and exit")
PHASES = ["pre-start", "post-start", "pre-stop", "post-stop"]
SKIP = {"--install-completion", "--show-completion", "--help", "-h"}


@dataclass
class Cmd:
    path: list[str]
    help: str
    args: list[str] = field(default_factory=list)        # metavars, e.g. VMID, [VMID]...
    options: list[tuple[str, str | None, str]] = field(default_factory=list)  # (names, metavar or None for a flag, help)
    subcommands: list[Cmd] = field(default_factory=list)

    @property
    def name(self) -> str:
        return " ".join(self.path)

    @property
    def takes_vmid(self) -> bool:
        return any("VMID" in a for a in self.args)


def _help(c: object) -> str:
    text = getattr(c, "help", None) or ""
    return re.sub(r"\s+", " ", text).strip()


def commands() -> Cmd:
    """The command tree of ``pvegpu`` (hidden options and typer's completion installers left out)."""
    import typer.main

    from pvegpu.cli.app import app

    root = typer.main.get_command(app)

    def walk(c: object, path: list[str]) -> Cmd:
        out = Cmd(path, _help(c))
        for p in getattr(c, "params", []):
            if getattr(p, "hidden", False):
                continue
            if p.param_type_name == "argument":
                name = p.metavar or p.name.upper()
                out.args.append((name if p.required else f"[{name}]") + ("..." if p.nargs != 1 else ""))
            else:
                names = [o for o in p.opts + list(getattr(p, "secondary_opts", [])) if o not in SKIP]
                if names:
                    out.options.append((", ".join(names), None if p.is_flag else (p.metavar or p.name.upper()), re.sub(r"\s+", " ", p.help or "").strip()))
        for name, sub in getattr(c, "commands", {}).items():
            if not getattr(sub, "hidden", False):
                out.subcommands.append(walk(sub, path + [name]))
        return out

    tree = walk(root, ["pvegpu"])  # its options: the global ones (the app's callback)
    for c in tree.subcommands:
        if c.path[-1] == "hook":  # as PVE calls it
            c.args = ["VMID", "PHASE"]
    return tree


def global_options(tree: Cmd) -> list[tuple[str, str | None, str]]:
    return tree.options + [HELP]


def all_commands(tree: Cmd) -> list[Cmd]:
    out = []
    for c in tree.subcommands:
        out.append(c)
        out.extend(all_commands(c))
    return out


# -- man page -----------------------------------------------------------------------------------------------

def _roff(text: str) -> str:
    text = text.replace("\\", "\\\\").replace("-", "\\-")
    text = re.sub(r"`([^`]*)`", r"\\fB\1\\fR", text)
    return "\n".join(("\\&" + ln) if ln.startswith((".", "'")) else ln for ln in text.split("\n"))


def exit_codes(readme: str | None) -> list[tuple[str, str]]:
    """The README's exit-code table (one source): (code, meaning) rows."""
    if not readme or not os.path.exists(readme):
        return []
    text = open(readme, encoding="utf-8").read()
    sec = text.split("## Exit codes", 1)[-1].split("\n## ", 1)[0] if "## Exit codes" in text else ""
    return [(m.group(1), m.group(2).strip()) for m in re.finditer(r"^\| (\d+\+?n?|\d+) \| (.*) \|$", sec, re.M)]


def man(version: str, readme: str | None = None, date: str | None = None) -> str:
    tree = commands()
    epoch = os.environ.get("SOURCE_DATE_EPOCH")  # reproducible builds: the date of the source, not of the build
    when = datetime.datetime.fromtimestamp(int(epoch), datetime.UTC) if epoch else datetime.datetime.now(datetime.UTC)
    date = date or when.date().isoformat()
    out = [f'.TH PVEGPU 1 "{date}" "pvegpu {version}" "pvegpu manual"',
           ".SH NAME", "pvegpu \\- verified GPU memory reclaim, start gate and audit for Proxmox VE guests",
           ".SH SYNOPSIS", ".B pvegpu", "[\\fIGLOBAL OPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]...",
           ".SH DESCRIPTION", _roff(tree.help.split(" Global options")[0]),
            "Full documentation: /usr/share/doc/pvegpu/README.md.gz and /usr/share/doc/pvegpu/docs/.",
            ".SH GLOBAL OPTIONS", "Given before the command, e.g. \\fBpvegpu \\-\\-config\\fR \\fIFILE\\fR \\fBreset 129\\fR."]
    for names, meta, text in global_options(tree):
        out += [".TP", f"\\fB{_roff(names)}\\fR" + (f" \\fI{meta}\\fR" if meta else ""), _roff(text)]
    out.append(".SH COMMANDS")
    for c in all_commands(tree):
        if c.subcommands and not c.args:  # a group (``pvegpu sim``): its help and its subcommands, each with its own section
            out += [".SS " + _roff(c.name), _roff(c.help), ".PP", "Subcommands: " + ", ".join(s.path[-1] for s in c.subcommands) + "."]
            continue
        out += [".SS " + _roff(c.name) + "".join(f" {_roff(a)}" for a in c.args) + (" [OPTIONS]" if c.options else ""), _roff(c.help)]
        if c.path[-1] == "hook":
            out += [".PP", "PHASE is one of " + ", ".join(PHASES) + "; subcommands: " +
                    ", ".join(s.path[-1] for s in c.subcommands) + "."]
        for names, meta, text in c.options:
            out += [".TP", f"\\fB{_roff(names)}\\fR" + (f" \\fI{_roff(meta)}\\fR" if meta else ""), _roff(text or "")]
    rows = exit_codes(readme)
    if rows:
        out.append(".SH EXIT STATUS")
        for code, text in rows:
            out += [".TP", f"\\fB{_roff(code)}\\fR", _roff(text.replace("**", ""))]
    out += [".SH FILES",
            ".TP", "\\fI/etc/pvegpu/pvegpu.toml\\fR", "settings (owner root, not writable by group or others)",
            ".TP", "\\fI/etc/pvegpu/token\\fR", "API token secret (owner root, mode 600)",
            ".TP", "\\fI/usr/share/pvegpu/\\fR", "the guard template, the Prometheus alert rules (and their promtool tests), pvegpu.toml.example",
            ".TP", "\\fI/usr/lib/systemd/system/pvegpu\\-*\\fR", "the audit timer and service, the NVIDIA device-node unit (not enabled by the package)",
            ".TP", "\\fI/var/lib/vz/snippets/pvegpu\\-guard\\fR", "the start gate written by \\fBpvegpu hook install\\fR",
            ".SH SEE ALSO", "\\fBpct\\fR(1), \\fBnvidia\\-smi\\fR(1)"]
    return "\n".join(out) + "\n"


# -- bash completion ----------------------------------------------------------------------------------------

def completion() -> str:
    tree = commands()
    cmds = all_commands(tree)
    top = " ".join(c.path[-1] for c in tree.subcommands)
    groups = " ".join(c.path[-1] for c in tree.subcommands if c.subcommands)  # hook, sim: their next word is a subcommand
    glob_opts = " ".join(n for names, _m, _t in global_options(tree) for n in names.split(", "))
    glob_val = "|".join(n for names, m, _t in global_options(tree) if m for n in names.split(", "))
    # every option that takes a value (global or a command's): its value is no command word
    vals = "|".join(dict.fromkeys([glob_val] + [n for c in cmds for names, m, _t in c.options if m for n in names.split(", ")]))
    lines = ["# bash completion for pvegpu (generated from the CLI by packaging/clidoc.py; VMIDs from /etc/pve/.vmlist,",
             "# or from DIR/etc-pve/.vmlist after --simulate DIR: every command then acts on the simulated node)",
             "_pvegpu_vmids() {",
             '    local f=${PVEGPU_VMLIST:-/etc/pve/.vmlist}',
             '    [ -n "$1" ] && f=${1/#\\~/$HOME}/etc-pve/.vmlist',
             '    [ -r "$f" ] || return 0',
             "    grep -o '\"[0-9][0-9]*\"[[:space:]]*:[[:space:]]*{' \"$f\" 2>/dev/null | tr -dc '0-9\\n'",
             "}",
             "_pvegpu() {",
             '    local cur prev i w cmd="" sub="" nargs=0 opts="" valopts="" vmid=0 sim=""',
             '    cur=${COMP_WORDS[COMP_CWORD]}; prev=${COMP_WORDS[COMP_CWORD-1]}',
             f'    case "$prev" in {glob_val}) COMPREPLY=($(compgen -f -- "$cur")); return 0 ;; esac',
             "    for ((i = 1; i < COMP_CWORD; i++)); do",
             '        w=${COMP_WORDS[i]}',
             '        case "$w" in --simulate) sim=${COMP_WORDS[i+1]} ;; --simulate=*) sim=${w#--simulate=} ;; esac',
             f'        case "$w" in {vals}) i=$((i + 1)); continue ;; -*) continue ;; esac',
             '        if [ -z "$cmd" ]; then cmd=$w; elif [[ " ' + groups + ' " == *" $cmd "* ]] && [ -z "$sub" ]; then sub=$w; else nargs=$((nargs + 1)); fi',
             "    done",
             '    case "$cmd${sub:+ $sub}" in']
    for c in cmds:
        opts = " ".join(n for names, _m, _t in c.options for n in names.split(", "))
        val = " ".join(n for names, m, _t in c.options if m in ("FILE", "DIR") for n in names.split(", "))  # file names
        vm = 1 if c.takes_vmid else 0
        lines.append(f'        "{" ".join(c.path[1:])}") opts="{opts}"; valopts="{val}"; vmid={vm} ;;')
    lines += ['        "") COMPREPLY=($(compgen -W "' + top + " " + glob_opts + '" -- "$cur")); return 0 ;;',
              '        "hook "[0-9]*) [ "$nargs" = 0 ] && COMPREPLY=($(compgen -W "' + " ".join(PHASES) + '" -- "$cur")); return 0 ;;',
              "    esac",
              '    for w in $valopts; do [ "$prev" = "$w" ] && { COMPREPLY=($(compgen -f -- "$cur")); return 0; }; done',
              f'    case "$prev" in {vals}) return 0 ;; esac  # a number, a storage name: nothing to offer\n    if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W "$opts --help" -- "$cur")); return 0; fi',
              '    if [ "$cmd" = hook ] && [ -z "$sub" ]; then',
              '        COMPREPLY=($(compgen -W "' + " ".join(s.path[-1] for c in cmds if c.path[-1] == "hook" for s in c.subcommands) +
              ' $(_pvegpu_vmids "$sim")" -- "$cur")); return 0',
              "    fi",
              *[f'    [ "$cmd" = {c.path[-1]} ] && [ -z "$sub" ] && {{ COMPREPLY=($(compgen -W "' + " ".join(s.path[-1] for s in c.subcommands)
                + '" -- "$cur")); return 0; }' for c in tree.subcommands if c.subcommands and c.path[-1] != "hook"],
              '    [ "$vmid" = 1 ] && COMPREPLY=($(compgen -W "$(_pvegpu_vmids "$sim")" -- "$cur"))',
              "    return 0",
              "}",
              "complete -F _pvegpu pvegpu", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from pvegpu import __version__

    if len(argv) >= 2 and argv[0] == "man":
        text = man(__version__, argv[2] if len(argv) > 2 else None)
    elif len(argv) == 2 and argv[0] == "completion":
        text = completion()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
