"""`pvegpu reset`'s command line: each option reaches the reset (the flags as its arguments, the seconds and
--no-restart as the settings they override), a bad line is a usage error (a pvegpu-error document under --json),
and an error of the run under --json is JSON too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pvegpu.cli import reset as cli_reset
from pvegpu.cli import run
from pvegpu.core.settings import ResetSettings
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0, "stand_in": "/dev/full"}


@pytest.mark.parametrize("line,flags,settings", [
    (["129"], {}, {}), (["129", "--json"], {"json_out": True}, {}), (["--json", "129"], {"json_out": True}, {}),
    (["129", "--dry-run", "--no-restart", "-v"], {"dry_run": True, "verbose": True}, {"restart": False}),
    (["129", "--verbose"], {"verbose": True}, {}), (["129", "--timeout", "5"], {}, {"timeout": 5.0}),
    (["129", "--timeout=7.5", "--grace", "1", "--settle=0.1"], {}, {"timeout": 7.5, "grace": 1.0, "settle": 0.1}),
    (["129", "--grace", "2", "--grace", "3"], {}, {"grace": 3.0}), (["--settle", "0", "129", "--json"], {"json_out": True}, {"settle": 0.0}),
])
def test_reset_options_reach_the_reset(monkeypatch, tmp_path, line, flags, settings):
    """Each option of `pvegpu reset` arrives: the flags as the reset's arguments, the seconds and --no-restart as the
    settings they override (the last of a repeated one wins); the rest keep their defaults."""
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    for k in [k for k in os.environ if k.startswith("PVEGPU_")]:
        monkeypatch.delenv(k)
    seen: list[tuple] = []
    monkeypatch.setattr(cli_reset, "do_reset", lambda s, vmid, **kw: seen.append((s, vmid, kw)) or 0)
    assert run(["--config", str(cfg), "reset", *line]) == 0
    (s, vmid, kw), = seen
    assert vmid == 129 and kw == {"dry_run": False, "json_out": False, "verbose": False} | flags
    default = ResetSettings()
    assert {k: getattr(s.reset, k) for k in ("timeout", "grace", "settle", "restart")} == {
        k: getattr(default, k) for k in ("timeout", "grace", "settle", "restart")} | settings


@pytest.mark.parametrize("line", [[], ["129", "130"], ["129", "--bogus"], ["129", "--timeout"], ["129", "--timeout", "x"],
                                  ["129", "--timeout", "-1"], ["129", "--json=1"], ["129", "-vx"]])
def test_a_bad_reset_line_is_a_usage_error(line, capsys):
    """A missing or extra VMID, an unknown option, a missing, bad or out-of-range value: exit 2, Error and Hint lines."""
    assert run(["reset", *line]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and "Hint: " in err and "Traceback" not in err, err


def _pvegpu(*args):
    return subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=60)


@pytest.fixture
def stopped_ct(sim_node):
    return sim_node({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "status": "stopped", "gpus": [0]}]})


def test_reset_errors_with_json_are_json(stopped_ct):
    """An unknown guest: exit 3, a JSON error object on stdout and the rendered error on stderr."""
    r = _pvegpu("--simulate", stopped_ct.root, "reset", "555", "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["exit_code"] == 3 and r.stderr.startswith("Error:")


@pytest.mark.parametrize("line", [["129", "--json", "--grace"], ["129", "--json", "--bogus"], ["129", "130", "--json"],
                                  ["129", "--json", "--timeout", "x"]])
def test_a_reset_usage_error_with_json_is_a_pvegpu_error_document(line, capsys):
    """`pvegpu reset ... --json` with a bad line: exit 2 and a pvegpu-error document on stdout (README: errors with --json)."""
    code = run(["reset", *line])
    out = capsys.readouterr().out
    assert code == 2
    doc = json.loads(out) if out.strip() else {}
    assert doc.get("schema") == "pvegpu-error" and doc.get("exit_code") == 2, out
