"""The command line: global options before the command, -h for every command, `hook VMID PHASE` as PVE calls it,
help in 80 columns, typos named with a suggestion, and errors as one rendering (message, hint, exit code; a
pvegpu-error document on stdout under --json, usage errors too), never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pvegpu.cli import is_hook_call, run
from pvegpu.core import errors as E
from tests import schemas
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0}


def pvegpu(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=60, env=env)


def pvegpu_clean(*args, timeout=90):
    """`pvegpu ARGS` with no PVEGPU_* variable of this environment; it never ends in a traceback."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    r = subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                       env=clean)
    assert "Traceback" not in r.stderr, r.stderr
    return r

@pytest.fixture
def node_cfg(sim_node, tmp_path):
    """A simulated node with a clean stopped CT 129, reachable only through a settings file."""
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [{"vmid": 129, "status": "stopped", "gpus": [0]}]})
    cfg = tmp_path / "pvegpu.toml"
    cfg.write_text(f'simulate = "{node.root}"\n[reset]\nlock_dir = "{tmp_path}/lock"\n')
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    return str(cfg)


@pytest.mark.parametrize("line", [
    ["--config", "{cfg}", "check", "129"], ["--config={cfg}", "check", "129", "--json"],
    ["--config", "{cfg}", "reset", "129", "--dry-run"], ["--config={cfg}", "audit", "--json"],
])
def test_config_is_honoured_before_the_command(node_cfg, line):
    """The settings file given before the command is read for check, reset and audit."""
    r = pvegpu(*[a.replace("{cfg}", node_cfg) for a in line])
    assert r.returncode in ((0, 8) if "audit" in line else (0,)), r.stdout + r.stderr  # audit: 8 = findings on the node
    if "audit" in line:
        assert json.loads(r.stdout)["nodes"][0]["node"] == "s"
    assert "Traceback" not in r.stderr


def test_the_hook_reads_its_settings_from_pvegpu_config(node_cfg):
    """`hook VMID PHASE` takes no options (PVE passes none): the settings file comes from PVEGPU_CONFIG."""
    r = pvegpu("hook", "129", "pre-start", env=dict(os.environ, PVEGPU_CONFIG=node_cfg))
    assert r.returncode == 0 and "may start" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("line,hint", [
    (["check", "129", "--config", "x.toml"], "`pvegpu --config FILE check ...`"),
    (["reset", "129", "--simulate=/tmp/node"], "`pvegpu --simulate DIR reset ...`"),
    (["hook", "status", "--version"], "`pvegpu --version`"),
    (["--config", "x.toml", "hook", "129", "pre-start"], "PVEGPU_CONFIG"),
    (["hook", "129", "pre-start", "--config", "x.toml"], "PVEGPU_CONFIG"),
])
def test_a_global_option_after_the_command_says_where_it_stands(line, hint):
    """A global option after the command (or any option on the hook's line) is exit 2 naming where it belongs."""
    r = pvegpu(*line)
    assert r.returncode == 2 and hint in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("line", [["--config", "{bad}", "check", "129"], ["--config", "{bad}", "reset", "129"], ["--config={bad}", "audit"]])
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
    r = pvegpu("hook", "129", phase, env=dict(os.environ, PVEGPU_CONFIG=str(bad)))
    assert r.returncode == code and r.stderr.startswith(text) and str(bad) in r.stderr if text else r.returncode == code, r.stderr


@pytest.mark.parametrize("line", [["--version"], ["--version", "check", "129"], ["--config", "x.toml", "--version", "reset"]])
def test_version_before_the_command(line):
    """--version prints the version and exits 0 (before anything else is read)."""
    r = pvegpu(*line)
    assert r.returncode == 0 and r.stdout.startswith("pvegpu ")


@pytest.mark.parametrize("line,text", [(["-h"], "Commands"), (["reset", "-h"], "Usage: pvegpu reset [OPTIONS] VMID"),
                                       (["check", "-h"], "Usage: pvegpu check [OPTIONS] VMID"), (["hook", "--help"], "hook VMID PHASE"),
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
    r = pvegpu("hook", "129", "pre-migrate", env=dict(os.environ, PVEGPU_CONFIG=node_cfg))
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


def test_only_pves_call_of_the_guard_skips_typer():
    """`hook VMID PHASE` (and a malformed VMID the hook explains) goes to the hook; hook's subcommands, their typos,
    help and every other command go to typer."""
    assert is_hook_call(["hook", "129", "pre-start"]) and is_hook_call(["hook", "12x", "pre-start"])
    assert is_hook_call(["hook", "129"])  # the hook says what PVE's call looks like
    for line in (["hook", "install"], ["hook", "instal"], ["hook", "--help"], ["hook", "129", "-h"], ["check", "129"], ["hook"], []):
        assert not is_hook_call(line), line


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

    from pvegpu.cli import hook

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


def test_simulate_without_a_value_hints_a_directory_not_a_settings_file():
    """`pvegpu --simulate` with no value: exit 2, and the hint never offers a .toml settings file as the DIR."""
    r = pvegpu_clean("--simulate")
    assert r.returncode == 2
    assert ".toml" not in r.stderr, r.stderr

COMMANDS = [[], ["reset"], ["check"], ["audit"], ["demo"], ["hook"], ["hook", "install"], ["hook", "uninstall"], ["hook", "status"],
            ["hook", "allow-once"], ["sim"], ["sim", "create"], ["sim", "remove"]]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_fits_80_columns_in_one_plain_style(cmd, capsys, monkeypatch):
    """Every command's help, on a terminal wider than 80 columns too: exit 0, click's plain style, no line over 80
    columns, no type names (`<str>`, `TEXT`) or doubled brackets (`[[VMID]...]...`)."""
    monkeypatch.setenv("COLUMNS", "200")
    assert run([*cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Usage: pvegpu") and max(len(line) for line in out.splitlines()) <= 80, out
    for noise in ("<str>", "<float>", "<list", "TEXT", "FLOAT", "[[", "{VMID}", "\u256d"):
        assert noise not in out, (noise, out)


def test_main_help_names_containers_and_vms_and_every_global_option(capsys):
    """`pvegpu --help` says what pvegpu is for (containers and VMs) and shows --config, --simulate and --version."""
    assert run(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "LXC containers and VMs" in out and all(o in out for o in ("--config FILE", "--simulate DIR", "--version"))


@pytest.mark.parametrize("line,bad,suggestion", [
    (["hook", "instal"], "'instal'", "'install'"), (["check", "129", "--jsno"], "--jsno", "--json"),
    (["rest", "129"], "'rest'", "'reset'"), (["reset", "129", "--dry-rn"], "--dry-rn", "--dry-run"),
    (["audit", "--clustr"], "--clustr", "--cluster"), (["sim", "creat", "/tmp/x"], "'creat'", "'create'"),
])
def test_a_typo_is_named_with_a_suggestion(line, bad, suggestion, capsys):
    """A mistyped command or option: exit 2, one Error line naming the bad word and suggesting the right one, one Hint
    line pointing at the command's help; nothing on stdout."""
    assert run(line) == 2
    got = capsys.readouterr()
    lines = got.err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Error: ") and lines[1].startswith("Hint: ") and "--help" in lines[1], got.err
    assert bad in lines[0] and suggestion in lines[0].split("Did you mean", 1)[1] and not got.out, got.err


def test_a_typo_with_json_is_a_pvegpu_error_document(capsys):
    """`check 129 --json --jsno`: the JSON consumer gets a pvegpu-error document naming the bad option, exit 2."""
    assert run(["check", "129", "--json", "--jsno"]) == 2
    doc = schemas.validate(json.loads(capsys.readouterr().out), "error")
    assert doc["exit_code"] == 2 and doc["command"] == "check" and "--jsno" in doc["error"]


@pytest.mark.parametrize("argv", [["reset", "--json"], ["reset", "129", "--json", "--bogus"], ["audit", "--json", "--bogus"],
                                  ["hook", "status", "--json", "extra"]])
def test_usage_errors_with_json_still_print_a_pvegpu_error_document(argv):
    """A usage error under --json (missing VMID, unknown option, extra argument): exit 2 and a pvegpu-error document."""
    r = pvegpu_clean(*argv)
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    schemas.validate(doc, "error")
    assert doc["exit_code"] == 2


@pytest.mark.parametrize("line", [[], ["hook"], ["sim"]])
def test_a_command_group_alone_shows_its_help(line, capsys):
    """`pvegpu`, `pvegpu hook` or `pvegpu sim` alone (a new admin's first try) shows that group's help with its
    commands (exit 2, click's usage error), never nothing at all."""
    assert run(line) == 2
    err = capsys.readouterr().err
    assert err.startswith("Usage: pvegpu") and "Commands:" in err and "Traceback" not in err, err


@pytest.mark.parametrize("line,code,said", [
    (["hook", "129"], 2, "usage: pvegpu hook VMID PHASE"), (["hook", "129", "pre-start", "extra"], 2, "usage: pvegpu hook VMID PHASE"),
    (["hook", "-1", "pre-start"], 2, "'-1' is not a container id"), (["hook", "129", "--help"], 0, "Usage: pvegpu hook"),
])
def test_odd_calls_of_the_hook_are_said_as_the_hook_sees_them(line, code, said, capsys):
    """`hook VMID PHASE` with a word missing or extra, or a negative vmid: the hook's own usage error naming what is
    wrong (exit 2), never typer's "No such option"; with --help: the hook's help (exit 0)."""
    assert run(line) == code
    out = capsys.readouterr()
    assert said in out.out + out.err and "No such option" not in out.err and "Traceback" not in out.err, out
