"""Review round 3 (review2): install/contract/sim/80-column breaks found by an adversarial read. Each test fails on
the reviewed main and passes once the named defect is fixed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import unicodedata

import pytest

from pvegpu.audit.render import audit_table
from tests import schemas
from tests.pvelike import REPO
from tests.test_columns import _doc, _holder


def _pvegpu(*args, timeout=90):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    r = subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                       env=clean)
    assert "Traceback" not in r.stderr, r.stderr
    return r


@pytest.mark.parametrize("argv", [["reset", "--json"], ["reset", "129", "--json", "--bogus"], ["audit", "--json", "--bogus"],
                                  ["hook", "status", "--json", "extra"]])
def test_usage_errors_with_json_still_print_a_pvegpu_error_document(argv):
    """README: errors with --json are a pvegpu-error document on stdout; a usage error (missing VMID, unknown option,
    extra argument) caught by typer prints nothing on stdout (check does print one: the contract is uneven)."""
    r = _pvegpu(*argv)
    assert r.returncode == 2
    doc = json.loads(r.stdout)  # fails: stdout is empty
    schemas.validate(doc, "error")
    assert doc["exit_code"] == 2


def _columns(line: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 0 if unicodedata.combining(c) else 1 for c in line)


def test_audit_with_a_wide_character_command_line_fits_80_terminal_columns():
    """A tenant command line of CJK characters (two terminal columns each) is elided by character count, so its
    audit line is ~140 columns wide on a terminal; the 80-column form must count display columns."""
    text = audit_table(_doc([_holder(cmdline="python3 " + "\u8bad\u7ec3" * 40, comm="python3")]))
    widest = max(text.splitlines(), key=_columns)
    assert _columns(widest) <= 80, widest


def _clidoc():
    spec = importlib.util.spec_from_file_location("clidoc_r2", os.path.join(REPO, "packaging", "clidoc.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["clidoc_r2"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_man_page_and_completion_know_check_wide(tmp_path):
    """`pvegpu check --help` offers --wide/-v, but clidoc hard-codes check's options to --json only: the man page
    and bash completion lack --wide."""
    doc = _clidoc()
    man = doc.man("0", os.path.join(REPO, "README.md"), date="2026-01-01")
    sec = man.split(".SS pvegpu check", 1)[1].split(".SS ", 1)[0]
    assert "\\-\\-wide" in sec, sec
    script = tmp_path / "c.bash"
    script.write_text(doc.completion())
    prog = f"source {script}; COMP_WORDS=(pvegpu check 129 --w); COMP_CWORD=3; _pvegpu; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    p = subprocess.run(["bash", "--norc", "--noprofile", "-c", prog], capture_output=True, text=True, timeout=30,
                       env={"PATH": os.environ["PATH"], "PVEGPU_VMLIST": str(tmp_path / "none")})
    assert "--wide" in p.stdout.split(), p.stdout


def test_sim_create_with_a_fifo_scenario_ends_with_exit_2_not_a_hang(tmp_path):
    """`sim create DIR --scenario FILE` (and `demo --scenario`) opens the file with a plain open(): a FIFO hangs it
    forever and /dev/zero is read until the OOM killer ends it; the settings file's rule (a regular file of bounded
    size, else exit 2) should hold for a scenario too."""
    fifo = tmp_path / "scenario.json"
    os.mkfifo(fifo)
    try:
        r = _pvegpu("sim", "create", str(tmp_path / "node"), "--scenario", str(fifo), timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("sim create hung on a FIFO scenario")
    assert r.returncode == 2 and not (tmp_path / "node").exists()


def test_hook_uninstall_keeps_the_guard_a_vm_hookscript_still_runs(tmp_path):
    """README 'VMs': a VM is guarded with `qm set VMID --hookscript local:snippets/pvegpu-guard`; `hook uninstall` of
    the last guarded container deletes that snippet anyway (it counts containers only), so the VM no longer starts.
    (packaging/debian/prerm likewise names only lxc/*.conf as still guarded, and install.refresh only containers'
    storages.)"""
    from pvegpu.cli import install as ins
    from tests.pvelike import etc_pve

    pve = etc_pve(str(tmp_path / "pve"), "pve1", {129: "arch: amd64\ndev0: /dev/nvidia0\nhookscript: local:snippets/pvegpu-guard\n"},
                  vms=(200,))
    with open(os.path.join(pve, "nodes", "pve1", "qemu-server", "200.conf"), "w") as f:
        f.write("hostpci0: 0000:01:00.0\nhookscript: local:snippets/pvegpu-guard\n")
    vz = tmp_path / "vz"
    (vz / "snippets").mkdir(parents=True)
    (vz / "snippets" / "pvegpu-guard").write_text(ins.guard_text(ins.template()))
    with open(os.path.join(pve, "storage.cfg"), "w") as f:
        f.write(f"dir: local\n\tpath {vz}\n\tcontent snippets\n")

    def run(argv):  # `pct set 129 --delete hookscript`
        conf = os.path.join(pve, "nodes", "pve1", "lxc", f"{argv[2]}.conf")
        text = open(conf).read()
        open(conf, "w").write("".join(ln for ln in text.splitlines(True) if not ln.startswith("hookscript:")))
        return 0, ""

    plan = ins.uninstall([129], pve_root=pve, node="pve1", run=run)
    assert plan.ok
    assert (vz / "snippets" / "pvegpu-guard").exists(), plan.done  # fails: removed while VM 200's hookscript names it


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="the settings snapshot is written by root only")
def test_simulate_writes_no_settings_snapshot_into_the_real_run_pvegpu(tmp_path, monkeypatch):
    """On a real node with /etc/pvegpu/pvegpu.toml, `pvegpu --simulate DIR ...` as root loads the default file with
    its snapshot, so it writes /run/pvegpu/settings.json: --simulate touches the node's real /run/pvegpu (README:
    "touches nothing real"). Fix: wiring.settings passes snapshot_dir=None (or one under DIR) when simulating."""
    from pvegpu import wiring
    from pvegpu.adapters import settingsfile

    conf = tmp_path / "etc" / "pvegpu.toml"
    conf.parent.mkdir()
    conf.write_text("[reset]\ngrace = 5\n")
    conf.chmod(0o644)
    monkeypatch.setattr(settingsfile, "RACY_NS", 0)  # the file counts as settled (on a node it is days old)
    real_run = tmp_path / "run-pvegpu"  # stands for the node's real /run/pvegpu
    monkeypatch.setattr(settingsfile, "DEFAULT_PATH", str(conf))
    monkeypatch.setattr(settingsfile, "SNAPSHOT_DIR", str(real_run))
    monkeypatch.delenv("PVEGPU_CONFIG", raising=False)
    sim = tmp_path / "node"
    sim.mkdir()
    sim.chmod(0o700)  # a node only its user can change (as `sim create` makes it), whatever the umask
    (sim / "scenario.json").write_text("{}")
    s = wiring.settings(wiring.GlobalOptions(simulate=str(sim)))
    assert s.reset.grace == 5
    assert not real_run.exists() or not os.listdir(real_run), os.listdir(real_run)


def test_simulate_without_a_value_hints_a_directory_not_a_settings_file():
    """`pvegpu --simulate` (no value) hints `pvegpu --simulate /etc/pvegpu/pvegpu.toml check 129`: the --config
    example pasted for --simulate, which takes a simulated node's DIR."""
    r = _pvegpu("--simulate")
    assert r.returncode == 2
    assert ".toml" not in r.stderr, r.stderr


def test_completion_after_simulate_offers_the_simulated_nodes_vmids(tmp_path):
    """`pvegpu --simulate DIR reset <TAB>` completes the real node's VMIDs (/etc/pve/.vmlist), not DIR's
    (DIR/etc-pve/.vmlist), though every command after --simulate acts on DIR."""
    node = tmp_path / "node"
    (node / "etc-pve").mkdir(parents=True)
    (node / "etc-pve" / ".vmlist").write_text('{"version": 1, "ids": {"555": {"node": "pve-sim", "type": "lxc", "version": 1}}}\n')
    real = tmp_path / "real.vmlist"
    real.write_text('{"version": 1, "ids": {"129": {"node": "pve1", "type": "lxc", "version": 1}}}\n')
    script = tmp_path / "c.bash"
    script.write_text(_clidoc().completion())
    prog = (f"source {script}; COMP_WORDS=(pvegpu --simulate {node} reset ''); COMP_CWORD=4; _pvegpu; "
            "printf '%s\\n' \"${COMPREPLY[@]}\"")
    p = subprocess.run(["bash", "--norc", "--noprofile", "-c", prog], capture_output=True, text=True, timeout=30,
                       env={"PATH": os.environ["PATH"], "PVEGPU_VMLIST": str(real)})
    assert p.stdout.split() == ["555"], p.stdout
