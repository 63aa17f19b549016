"""One front door: --config, --version and -h work for every command wherever they stand on the line, and
errors come out as one rendering (message, hint, exit code), never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pvegpu import errors as E
from pvegpu.frontdoor import is_gate_command, split_globals
from tests import schemas
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0}


def pvegpu(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=60, env=env)


@pytest.fixture
def node_cfg(sim_node, tmp_path):
    """A simulated node with a clean stopped CT 129, reachable only through a settings file."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "status": "stopped", "gpus": [0]}]})
    cfg = tmp_path / "pvegpu.toml"
    cfg.write_text(f'simulate = "{node.root}"\n[reset]\nlock_dir = "{tmp_path}/lock"\n')
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    return str(cfg)


@pytest.mark.parametrize("line", [
    ["--config", "{cfg}", "check", "129"], ["check", "129", "--config", "{cfg}"], ["check", "--config={cfg}", "129"],
    ["--config", "{cfg}", "hook", "129", "pre-start"], ["hook", "129", "pre-start", "--config", "{cfg}"],
    ["reset", "129", "--dry-run", "--config", "{cfg}"], ["--config={cfg}", "audit", "--json"],
])
def test_config_is_honoured_wherever_it_stands(node_cfg, line):
    """The settings file is read for check, hook, reset and audit, before or after the subcommand."""
    r = pvegpu(*[a.replace("{cfg}", node_cfg) for a in line])
    assert r.returncode in ((0, 8) if "audit" in line else (0,)), r.stdout + r.stderr  # audit: 8 = findings on the node
    if "audit" in line:
        assert json.loads(r.stdout)["nodes"][0]["node"] == "s"
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("line", [["--config", "{bad}", "check", "129"], ["reset", "129", "--config", "{bad}"], ["audit", "--config={bad}"]])
def test_bad_config_file_is_an_error_for_every_command(tmp_path, line):
    """A broken settings file given with --config is never silently ignored (exit 2, the file named)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[reset\n")
    bad.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    r = pvegpu(*[a.replace("{bad}", str(bad)) for a in line])
    assert r.returncode == 2 and str(bad) in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("phase,code,text", [("pre-start", 10, "pvegpu: refusing to start CT 129: invalid settings"),
                                             ("post-stop", 0, "pvegpu: post-stop check of CT 129 not done: invalid settings"),
                                             ("post-start", 0, "")])
def test_broken_settings_in_the_hook_fail_closed_with_the_gates_code(tmp_path, phase, code, text):
    """Broken settings at pre-start refuse the start with the gate's exit 10 and the reason in the task log; post-stop
    never fails a stop; other phases exit 0 at once."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[reset]\ngrace = 0\n")
    bad.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    r = pvegpu("hook", "129", phase, "--config", str(bad))
    assert r.returncode == code and r.stderr.startswith(text) and str(bad) in r.stderr if text else r.returncode == code, r.stderr


@pytest.mark.parametrize("line", [["--version"], ["check", "--version"], ["reset", "129", "--version"], ["hook", "--version"]])
def test_version_anywhere(line):
    """--version prints the version and exits 0 wherever it stands."""
    r = pvegpu(*line)
    assert r.returncode == 0 and r.stdout.startswith("pvegpu ")


@pytest.mark.parametrize("line,text", [(["-h"], "Commands"), (["reset", "-h"], "Usage: pvegpu reset [OPTIONS] VMID"),
                                       (["check", "-h"], "check VMID"), (["hook", "--help"], "hook VMID PHASE"),
                                       (["hook", "129", "-h"], "hook VMID PHASE"), (["audit", "--help"], "--json")])
def test_help_short_and_long(line, text):
    """-h and --help work for the main command and every subcommand; hook's help documents `hook VMID PHASE`."""
    r = pvegpu(*line)
    assert r.returncode == 0 and text in r.stdout, r.stdout + r.stderr
    assert "<bool>" not in r.stdout and "{VMID}" not in r.stdout


def test_check_json_errors_are_json(node_cfg):
    """check --json answers in JSON even when it fails (here: an unknown guest, exit 3): a check document that refuses."""
    r = pvegpu("--config", node_cfg, "check", "999", "--json")
    assert r.returncode == 3
    doc = schemas.validate(json.loads(r.stdout), "check")
    assert doc["allow"] is False and doc["exit_code"] == 3 and doc["error"] == "no guest 999 in this cluster" and doc["hint"]


def test_hook_errors_carry_the_pvegpu_prefix(node_cfg):
    """A bad hook argument is one prefixed line (it lands in the PVE task log), exit 2."""
    r = pvegpu("--config", node_cfg, "hook", "129", "pre-migrate")
    assert r.returncode == 2 and r.stderr.startswith("pvegpu: Error: unknown hook phase 'pre-migrate'"), r.stderr


def test_unknown_command_and_option_are_usage_errors():
    """An unknown command or option is exit 2 with the one error rendering, not click's traceback or box."""
    for line in (["frobnicate"], ["reset", "129", "--frob"]):
        r = pvegpu(*line)
        assert r.returncode == 2 and r.stderr.startswith("Error: ") and "Hint: " in r.stderr, r.stderr


def test_not_a_pve_node_is_one_message_for_every_command(tmp_path):
    """Off a PVE node without an API: reset, check, hook, audit all say the same thing with exit 3."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'pve_root = "{tmp_path}/none"\n[reset]\nlock_dir = "{tmp_path}/lock"\n')
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    outs = set()
    for line in (["reset", "129"], ["check", "129"], ["audit"], ["reset", "129", "--dry-run"]):
        r = pvegpu("--config", str(cfg), *line)
        assert r.returncode == 3, (line, r.stderr)
        outs.add(r.stderr.splitlines()[0])
    assert outs == {f"Error: not a Proxmox VE node: {tmp_path}/none/.vmlist not found and no API configured"}


def test_split_globals_keeps_the_rest_in_order():
    """The front door's one rule: global options come off the line, everything else stays as it was."""
    found, rest = split_globals(["hook", "--config", "a.toml", "129", "pre-start", "--version"])
    assert found == {"config": "a.toml", "version": True} and rest == ["hook", "129", "pre-start"]
    with pytest.raises(E.UsageError):
        split_globals(["check", "129", "--config"])
    assert is_gate_command(["hook", "129", "pre-start"]) and not is_gate_command(["hook", "install"])
    assert not is_gate_command(["hook", "--help"]) and is_gate_command(["check"])


def test_render_is_message_hint_and_prefix():
    """errors.render: `Error:` and `Hint:` lines, with an optional prefix for the task log."""
    exc = E.NotFoundError("no guest 7", "pct list")
    assert E.render(exc) == "Error: no guest 7\nHint: pct list"
    assert E.render(exc, prefix="pvegpu: ") == "pvegpu: Error: no guest 7\npvegpu: Hint: pct list"
    assert E.to_json(exc) == {"error": "no guest 7", "hint": "pct list", "exit_code": 3}


def test_errors_render_themselves():
    """A PvegpuError renders itself (lines, JSON, one task-log line) and crosses the gate's pipe as its JSON, exit code kept."""
    import io

    exc = E.NotFoundError("no guest 7", "pct list")
    assert exc.render("pvegpu: ") == E.render(exc, prefix="pvegpu: ") and exc.to_json() == E.to_json(exc)
    assert exc.inline("fix") == "no guest 7 (fix: pct list)" and E.UsageError("bad").inline() == "bad"
    back = E.PvegpuError.from_json(exc.to_json())
    assert (back.message, back.hint, back.exit_code) == ("no guest 7", "pct list", E.EXIT_NOT_FOUND)
    assert E.PvegpuError.from_json({"error": "x", "exit_code": "7"}).exit_code == E.EXIT_FAILURE  # a forged code is not trusted
    out, err = io.StringIO(), io.StringIO()
    assert exc.show(err, out) == E.EXIT_NOT_FOUND
    assert json.loads(out.getvalue())["exit_code"] == E.EXIT_NOT_FOUND and err.getvalue() == exc.render() + "\n"


def test_hook_error_sites_use_the_error_rendering():
    """hook.py formats no error with its hint by hand: the Error/Hint lines and the task-log line come from the error's methods."""
    import inspect

    from pvegpu import hook

    src = inspect.getsource(hook)
    assert "exc.hint" not in src and "E.render(" not in src and "E.to_json(" not in src


def test_simulate_on_an_existing_directory_that_is_no_node_hints_a_new_directory(tmp_path):
    """`--simulate DIR` where DIR holds files but no node (e.g. /etc): the hint never says `sim create DIR`; an absent
    DIR is hinted as itself."""
    from pvegpu import wiring

    full = tmp_path / "full"
    full.mkdir()
    (full / "passwd").write_text("x\n")
    with pytest.raises(E.UsageError) as exc:
        wiring.settings(wiring.GlobalOptions(simulate=str(full)))
    assert f"sim create {full}`" not in (exc.value.hint or "") and "sim create " in (exc.value.hint or "")
    with pytest.raises(E.UsageError) as exc:
        wiring.settings(wiring.GlobalOptions(simulate=str(tmp_path / "new")))
    assert f"sim create {tmp_path / 'new'}`" in (exc.value.hint or "")
