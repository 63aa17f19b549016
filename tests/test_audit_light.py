"""``pvegpu audit`` on its light parser: one option table for it and for typer, the same values, output and exit codes
either way, typer for everything the light parser is not sure of, and no typer on the audit's path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pvegpu import auditcmd
from pvegpu.install import fast_path
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0, "stand_in": "/dev/full"}


def _typer_audit():
    import typer.main

    from pvegpu import cli

    return typer.main.get_command(cli.app).commands["audit"]  # type: ignore[attr-defined]


def test_the_typer_audit_command_is_built_from_the_table():
    """Every option of the table is the typer command's, with its flags, help, metavar, default, kind and hiding."""
    cmd = _typer_audit()
    params = {p.name: p for p in cmd.params if p.name != "help"}
    assert set(params) == {o.dest for o in auditcmd.OPTIONS}
    for o in auditcmd.OPTIONS:
        p = params[o.dest]
        assert set(p.opts + p.secondary_opts) == set(o.decls)
        assert p.help == o.help and p.is_flag == (o.kind == "flag") and (p.metavar or "") == o.metavar
        assert p.hidden == o.hidden and p.multiple == (o.kind == "texts")
        assert p.default == ([] if o.kind == "texts" else o.default) or (o.kind == "texts" and not p.default)


LINES = [
    [], ["--json"], ["-v"], ["--wide"], ["--verbose", "--json"], ["--cluster", "--json"], ["--prometheus", "/tmp/x.prom"],
    ["--prometheus=/tmp/y.prom", "--json"], ["--prometheus="], ["--ssh-timeout", "5"], ["--ssh-timeout=2.5", "--cluster"],
    ["--ssh-timeout", "1_0"], ["--ssh-timeout", "0"], ["--ssh-timeout", "nan"],
    ["--ssh-option", "Port=2222", "--ssh-option=-i", "--ssh-option", "k"], ["--json", "--json"],
    ["--prometheus", "a", "--prometheus", "b"], ["--ssh-timeout", "3", "--ssh-timeout", "4"],
]


@pytest.mark.parametrize("line", LINES)
def test_light_audit_parser_and_typer_read_a_line_alike(monkeypatch, line):
    """For every line the light parser takes, typer calls the same entry point with the same values."""
    from pvegpu import cli

    seen: list[dict] = []
    monkeypatch.setattr(auditcmd, "run", lambda values, opts: seen.append(dict(values)) or 0)
    assert cli.run(["audit", *line], cli.wiring.GlobalOptions()) == 0
    light = auditcmd.parse(line)
    assert light is not None
    assert json.dumps(light, sort_keys=True, default=str) == json.dumps(seen[0], sort_keys=True, default=str)


@pytest.mark.parametrize("line", [
    ["--help"], ["-h"], ["--json", "-h"], ["129"], ["--bogus"], ["--json=1"], ["--ssh-timeout"], ["--ssh-timeout", "x"],
    ["--ssh-timeout", "-1"], ["--prometheus"], ["--prometheus", "--json"], ["--ssh-option", "-p"], ["--", "--json"], ["-vx"],
    ["-"], ["--wid"],
])
def test_light_audit_parser_leaves_what_it_is_not_sure_of_to_typer(line):
    """Help, unknown or abbreviated options, a flag given a value, missing, bad or dash-led values, ``--`` and any word go
    to typer."""
    assert auditcmd.parse(line) is None


def test_the_audit_path_imports_no_typer():
    """``pvegpu audit`` starts without typer, click, pydantic or rich (the front door parses its line)."""
    out = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path[:0] = {fast_path()!r}.split(':'); "
                          "import pvegpu.frontdoor, pvegpu.auditcmd, pvegpu.audit, pvegpu.render_audit; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    mods = set(out.stdout.split())
    assert "pvegpu.auditcmd" in mods and not mods & {"typer", "click", "pydantic", "rich", "pvegpu.cli"}


def _both(root: str, *line: str) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """The line through the front door (light path) and through typer (``cli.run``), as whole processes."""
    light = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", root, "audit", *line], capture_output=True, text=True,
                           cwd=REPO, timeout=60)
    typer = subprocess.run([sys.executable, "-c", "import sys; from pvegpu import cli, wiring; "
                            f"sys.exit(cli.run(['audit', *{list(line)!r}], wiring.GlobalOptions(None, {root!r})))"],
                           capture_output=True, text=True, cwd=REPO, timeout=60)
    return light, typer


def _steady(doc: dict) -> dict:
    doc.pop("generated_at", None)
    for n in doc.get("nodes", []):
        n.pop("duration_seconds", None)
    return doc


@pytest.fixture
def busy_node(sim_node):
    return sim_node({"node": "s", "gpus": [GPU], "containers": [
        {"vmid": 129, "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 512}]},
        {"vmid": 130, "status": "stopped", "gpus": [0]}]})


def test_audit_json_through_the_light_path_is_the_typer_audit(busy_node):
    """``audit --json`` through the front door and through typer: the same exit code and the same document."""
    light, typer = _both(busy_node.root, "--json")
    assert light.returncode == typer.returncode and light.returncode in (0, 8), light.stderr + typer.stderr
    a, b = _steady(json.loads(light.stdout)), _steady(json.loads(typer.stdout))
    assert a["schema"] == "pvegpu-audit" and a == b


@pytest.mark.parametrize("line", [(), ("-v",)])
def test_audit_text_through_the_light_path_is_the_typer_audit(busy_node, line):
    """The table (80 columns, and ``-v``) is the same either way, but for the run's own time."""
    light, typer = _both(busy_node.root, *line)
    assert light.returncode == typer.returncode and light.returncode in (0, 8), light.stderr + typer.stderr
    assert len(light.stdout.splitlines()) == len(typer.stdout.splitlines()) > 2
    steady = [(a, b) for a, b in zip(light.stdout.splitlines(), typer.stdout.splitlines(), strict=True) if a != b]
    assert all(any(c.isdigit() for c in a) for a, _ in steady) and len(steady) <= 1  # at most the line with the duration


@pytest.mark.parametrize("line", [("--json", "--ssh-timeout", "0"), ("--ssh-timeout=-2",), ("--json", "--prometheus", "/proc/no/such/dir/x.prom")])
def test_audit_errors_are_the_same_on_both_paths(busy_node, line):
    """A bad value and an unwritable textfile: the same exit code, the same error document with --json, an error on stderr."""
    light, typer = _both(busy_node.root, *line)
    assert light.returncode == typer.returncode == 2, light.stderr + typer.stderr
    assert light.stderr.startswith("Error:") and typer.stderr.startswith("Error:")
    if "--json" in line:
        a, b = json.loads(light.stdout), json.loads(typer.stdout)
        assert a == b and a["schema"] == "pvegpu-error" and a["command"] == "audit" and a["exit_code"] == 2


def test_a_line_typer_must_judge_still_gets_typers_answer(busy_node):
    """An unknown option after ``audit``: exit 2 with a usage error, and its JSON error document with --json, as before."""
    r = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", busy_node.root, "audit", "--json", "--bogus"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and json.loads(r.stdout)["schema"] == "pvegpu-error" and "bogus" in r.stderr
