"""What a new admin meets (issue 30, items 6, 10, 12, 13, 15): outside faults and user mistakes are one line with a
hint and the README's exit code, never "internal error"; a user other than root is told to run as root; the way
out after removing pvegpu is named; the maintainer scripts print nothing raw; one format for a reset screen's MiB."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import pytest

from pvegpu.audit.model import ADVICE, FlagKind
from pvegpu.cli import install as ins
from pvegpu.sim import scenario as sc
from tests.pvelike import REPO, etc_pve

GPU_CONF = "arch: amd64\ndev0: /dev/nvidia0,gid=44\n"
GUARD_LINE = "hookscript: local:snippets/pvegpu-guard\n"
NOBODY = 65534
PACKAGING = os.path.join(REPO, "packaging")


def _pvegpu(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


def _one_error(r: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """The ``Error:`` and ``Hint:`` lines of a failed run, asserting that is all it said on stderr."""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("Error: ") and lines[1].startswith("Hint: "), r.stderr
    assert "internal error" not in r.stderr, r.stderr
    return lines[0], lines[1]


# -- item 6: hook install onto a snippets storage that cannot be written ------------------------------------------


def _node(tmp: str, confs: dict[int, str]) -> tuple[str, str]:
    """A PVE-like /etc/pve with ``confs`` on node pve1 and a ``local`` dir storage at ``tmp/vz`` (no snippets dir yet)."""
    pve = etc_pve(os.path.join(tmp, "pve"), "pve1", confs)
    vz = os.path.join(tmp, "vz")
    os.makedirs(vz, exist_ok=True)
    os.chmod(vz, 0o755)
    with open(os.path.join(pve, "storage.cfg"), "w") as f:
        f.write(f"dir: local\n\tpath {vz}\n\tcontent snippets\n")
    return pve, vz


class _Runs:
    """A stand-in ``pct``/``pvesm`` runner that records every command; with ``pve``, ``pct set N --delete
    hookscript`` takes the line out of CT N's config there, as pct does."""

    def __init__(self, pve: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.pve = pve

    def __call__(self, argv: list[str]) -> tuple[int, str]:
        self.calls.append(argv)
        if self.pve and argv[:2] == ["pct", "set"] and argv[3:] == ["--delete", "hookscript"]:
            path = os.path.join(self.pve, "nodes", "pve1", "lxc", f"{argv[2]}.conf")
            with open(path) as f:
                kept = [ln for ln in f if not ln.startswith("hookscript:")]
            with open(path, "w") as f:
                f.writelines(kept)
        return 0, ""


@pytest.mark.root
def test_hook_install_onto_a_read_only_storage_without_a_snippets_directory_exits_8_naming_path_and_cause(tmp_path):
    """Read-only storage, snippets directory still to create: exit 8, one refused line with path, EROFS and fix; no pct set."""
    pve, vz = _node(str(tmp_path), {129: GPU_CONF})
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("pct", "pvesm"):
        (bindir / tool).write_text(f"#!/bin/sh\necho \"$0 $*\" >> {tmp_path}/calls.log\n")
        (bindir / tool).chmod(0o755)
    (tmp_path / "c.toml").write_text(f'pve_root = "{pve}"\nnode = "pve1"\n')
    subprocess.run(["mount", "--bind", vz, vz], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", vz], check=True)
        r = _pvegpu("hook", "install", env={"PATH": f"{bindir}:{os.environ['PATH']}", "PVEGPU_CONFIG": str(tmp_path / "c.toml")})
    finally:
        subprocess.run(["umount", vz], check=True)
    assert r.returncode == 8, r.stdout + r.stderr
    refused = [ln for ln in r.stderr.splitlines() if ln.startswith("refused: ")]
    assert len(refused) == 1 and f"{vz}/snippets/pvegpu-guard" in refused[0] and "Read-only file system (EROFS)" in refused[0], r.stderr
    assert "Fix: remount" in refused[0] and "internal error" not in r.stderr
    assert not (tmp_path / "calls.log").exists() and not os.path.exists(os.path.join(vz, "snippets"))


@pytest.mark.parametrize("code,fix", [(errno.ENOSPC, "free space"), (errno.EACCES, "root_squash"), (errno.EROFS, "read-write")])
def test_hook_install_when_the_guard_cannot_be_written_is_refused_naming_cause_and_nothing_changes(tmp_path, monkeypatch, code, fix):
    """Full, root-squashed or read-only storage: install refuses naming the guard's path, the cause and its fix; no pvesm/pct set."""
    pve, vz = _node(str(tmp_path), {129: GPU_CONF})

    def fail(*_a: object, **_k: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(ins, "write_atomic", fail)
    runs = _Runs()
    plan = ins.install([], pve_root=pve, node="pve1", run=runs, guard="#!/bin/sh\nexit 0\n", deadline=10)
    assert not plan.ok and plan.done == [] and runs.calls == [] and os.listdir(vz) == []
    (line,) = plan.refused
    assert f"{vz}/snippets/pvegpu-guard" in line and os.strerror(code) in line and errno.errorcode[code] in line and fix in line, line


def test_hook_install_says_what_it_did_when_one_chain_script_cannot_be_written(tmp_path, monkeypatch):
    """A chain script that cannot be written refuses that CT only; the CT already guarded is reported done."""
    pve, vz = _node(str(tmp_path), {129: GPU_CONF, 130: GPU_CONF + "hookscript: local:snippets/mine.pl\n"})
    real = ins.write_atomic

    def full_for_chains(path: str, text: str, mode: int = 0o755) -> None:
        if "-chain-" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, text, mode)

    monkeypatch.setattr(ins, "write_atomic", full_for_chains)
    runs = _Runs()
    plan = ins.install([], pve_root=pve, node="pve1", chain=True, run=runs, guard="#!/bin/sh\nexit 0\n", deadline=10)
    assert ["pct", "set", "129", "--hookscript", "local:snippets/pvegpu-guard"] in runs.calls
    assert not any(c[:3] == ["pct", "set", "130"] for c in runs.calls)
    assert any("pct set 129" in d for d in plan.done) and len(plan.refused) == 1
    assert plan.refused[0].startswith("CT 130: cannot write its chain script") and "(ENOSPC)" in plan.refused[0]


def test_hook_uninstall_on_a_read_only_storage_unguards_and_names_the_snippet_it_could_not_remove(tmp_path, monkeypatch):
    """uninstall on a read-only storage takes the guard off and warns, naming the snippet and cause, never an internal error."""
    pve, vz = _node(str(tmp_path), {129: GPU_CONF + GUARD_LINE})
    os.makedirs(os.path.join(vz, "snippets"))
    guard = os.path.join(vz, "snippets", "pvegpu-guard")
    with open(guard, "w") as f:
        f.write("#!/bin/sh\n")

    def read_only(path: str) -> bool:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(ins, "_remove", read_only)
    runs = _Runs(pve)
    plan = ins.uninstall([], pve_root=pve, node="pve1", run=runs, deadline=10)
    assert runs.calls == [["pct", "set", "129", "--delete", "hookscript"]] and plan.ok
    assert any(guard in w and "Read-only file system (EROFS)" in w for w in plan.warnings), plan.warnings


# -- item 12: a user other than root ------------------------------------------------------------------------------


@pytest.fixture
def shared_tmp():
    """A temporary directory a user other than root can enter (pytest's own is root's, mode 700)."""
    d = tempfile.mkdtemp(prefix="pvegpu-admin-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _user_python() -> str:
    """As root: an interpreter uid 65534 can run pvegpu with, this one or the system's of the same version (pvegpu's
    venv may live under root's home), else the test skips."""
    version = "%d.%d" % sys.version_info[:2]
    for python in (sys.executable, f"/usr/bin/python{version}"):
        probe = _as_user_cmd(python, ["--version"])
        try:
            p = subprocess.run(probe, capture_output=True, text=True, timeout=60, user=NOBODY, group=NOBODY, extra_groups=[], cwd="/")
        except OSError:
            continue
        if p.returncode == 0 and p.stdout.strip() == f"pvegpu {_version()}":
            return python
    pytest.skip("no Python of this version that a user other than root can run pvegpu with")


def _version() -> str:
    from pvegpu import __version__

    return __version__


def _as_user_cmd(python: str, args: list[str]) -> list[str]:
    """``pvegpu ARGS`` with this checkout and this venv's site-packages first on the path (a user's ``-I`` run)."""
    code = "import sys; sys.path[:0] = sys.argv[1:3]; del sys.argv[1:3]; sys.argv[0] = 'pvegpu'; from pvegpu.__main__ import main; main()"
    return [python, "-I", "-c", code, REPO, sysconfig.get_paths()["purelib"], *args]


def _as_user(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``pvegpu ARGS`` as a user other than root (uid 65534 when the tests run as root, else the tests' own user)."""
    if os.geteuid() != 0:
        return _pvegpu(*args, env=env)
    return subprocess.run(_as_user_cmd(_user_python(), args), capture_output=True, text=True, timeout=60, cwd="/",
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8", **env},
                          user=NOBODY, group=NOBODY, extra_groups=[])


def _root_only(path: str) -> None:
    """``path`` readable by root only, as pmxcfs gives /etc/pve's guest files to root and www-data (0440/0640):
    root's when the tests run as root, else this user's with no permission at all (the owner is refused too)."""
    os.chmod(path, 0o440 if os.geteuid() == 0 else 0)


def _user_node(tmp: str, *, vmlist_readable: bool) -> str:
    """A node's /etc/pve whose guest configs (and, unless ``vmlist_readable``, .vmlist) only root may read, and a
    settings file naming it; returns the settings file."""
    pve, _ = _node(tmp, {129: GPU_CONF + GUARD_LINE})
    _root_only(os.path.join(pve, "nodes", "pve1", "lxc", "129.conf"))
    _root_only(os.path.join(pve, "storage.cfg"))
    if not vmlist_readable:
        _root_only(os.path.join(pve, ".vmlist"))
    cfg = os.path.join(tmp, "c.toml")
    with open(cfg, "w") as f:
        f.write(f'pve_root = "{pve}"\n')
    os.chmod(cfg, 0o644)
    return cfg


@pytest.mark.parametrize("args", [["reset", "129"], ["check", "129"], ["audit"], ["hook", "status"], ["hook", "install"],
                                  ["check", "129", "--json"]])
def test_a_user_other_than_root_on_a_node_is_told_to_run_as_root(shared_tmp, args):
    """A user on a node: exit 2, one line "must run as root", hint "run it as root"; never pmxcfs, internal error or audit findings."""
    cfg = _user_node(shared_tmp, vmlist_readable=False)
    r = _as_user(args, {"PVEGPU_CONFIG": cfg})
    assert r.returncode == 2, r.stdout + r.stderr
    err, hint = _one_error(r)
    assert "root" in err and "root" in hint and "pmxcfs" not in r.stderr, r.stderr
    if args[0] != "hook" or args[1] != "install":  # install says root@pam may set hookscripts, and to run it as root
        assert "must run as root" in err and hint == "Hint: run it as root (root's shell on the node, or `sudo pvegpu ...`)", r.stderr
    if "--json" in args:
        assert '"exit_code": 2' in r.stdout and "must run as root" in r.stdout


@pytest.mark.parametrize("args", [["check", "129"], ["hook", "status"]])
def test_a_user_who_may_read_the_guest_list_but_not_the_configs_is_told_to_run_as_root(shared_tmp, args):
    """A user allowed .vmlist but not the configs or storage.cfg: exit 2 "must run as root" naming the file."""
    cfg = _user_node(shared_tmp, vmlist_readable=True)
    r = _as_user(args, {"PVEGPU_CONFIG": cfg})
    assert r.returncode == 2, r.stdout + r.stderr
    err, _ = _one_error(r)
    assert "must run as root" in err and shared_tmp in err, err


@pytest.mark.parametrize("args", [["audit"], ["check", "129"], ["reset", "129"], ["hook", "status"]])
def test_simulate_variable_naming_no_simulated_node_is_one_line_and_exit_2(tmp_path, args):
    """PVEGPU_SIMULATE=/nonexistent: exit 2, one line naming the variable, a hint to build a node; not "internal error"."""
    r = _pvegpu(*args, env={"PVEGPU_SIMULATE": str(tmp_path / "nonexistent")})
    assert r.returncode == 2, r.stdout + r.stderr
    err, hint = _one_error(r)
    assert f"PVEGPU_SIMULATE={tmp_path}/nonexistent" in err and "pvegpu sim create" in hint


@pytest.mark.root(reason="needs root: root's simulated node, which a user may not use, is made by root (a user's own node is theirs)")
@pytest.mark.parametrize("how", ["--simulate", "PVEGPU_SIMULATE"])
def test_another_users_simulated_node_is_refused_with_a_hint_not_an_internal_error(shared_tmp, how):
    """A user using root's simulated node: exit 2, one line naming it with a hint, not an internal error."""
    node = os.path.join(shared_tmp, "node")
    os.mkdir(node)
    os.chmod(node, 0o755)
    with open(os.path.join(node, "scenario.json"), "w") as f:
        f.write('{"node": "pve-sim", "gpus": [], "containers": []}\n')
    _root_only(os.path.join(node, "scenario.json"))
    args, env = (["--simulate", node, "audit"], {}) if how == "--simulate" else (["audit"], {"PVEGPU_SIMULATE": node})
    r = _as_user(args, env)
    assert r.returncode == 2, r.stdout + r.stderr
    err, hint = _one_error(r)
    assert node in err and "pvegpu sim create" in hint, r.stderr


# -- item 13: after removal, and a gate deliberately not installed ----------------------------------------------------


def test_hook_status_of_a_node_where_the_gate_was_taken_off_is_nothing_to_report(tmp_path):
    """No guest runs the guard and no snippet is there (after uninstall): status ok, not installed, containers still listed."""
    pve, _ = _node(str(tmp_path), {129: GPU_CONF, 131: "arch: amd64\n"})
    st = ins.status(pve_root=pve, node="pve1", guard="#!/bin/sh\n", deadline=10)
    assert st.ok and st.installed is False and st.problems == [] and "not installed" in st.notes[0]
    assert [(r.vmid, r.state) for r in st.containers] == [(129, ins.GuardState.UNGUARDED)]
    assert st.to_json()["installed"] is False


@pytest.mark.parametrize("half", ["a guarded neighbour", "a snippet no guest uses", "a VM that runs the guard"])
def test_hook_status_of_a_half_installed_gate_is_attention(tmp_path, half):
    """An unguarded GPU container beside any trace of the gate on the node is still attention (exit 8)."""
    confs = {129: GPU_CONF, 130: GPU_CONF + GUARD_LINE} if half == "a guarded neighbour" else {129: GPU_CONF}
    pve, vz = _node(str(tmp_path), confs)
    if half == "a snippet no guest uses":
        os.makedirs(os.path.join(vz, "snippets"))
        with open(os.path.join(vz, "snippets", "pvegpu-guard"), "w") as f:
            f.write("#!/bin/sh\n")
    if half == "a VM that runs the guard":
        with open(os.path.join(pve, "nodes", "pve1", "qemu-server", "200.conf"), "w") as f:
            f.write("hostpci0: 0000:01:00.0\n" + GUARD_LINE)
    st = ins.status(pve_root=pve, node="pve1", guard="#!/bin/sh\n", deadline=10)
    assert not st.ok and st.installed and st.notes == []


def _guard_copy(tmp_path, pvegpu_bin: str) -> str:
    path = tmp_path / "pvegpu-guard"
    path.write_text(ins.guard_text(ins.template(), pvegpu_bin, fast=False))
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("phase,code", [("pre-start", 10), ("post-stop", 0)])
def test_guard_without_pvegpu_names_the_way_out_pct_set_delete_hookscript(tmp_path, phase, code):
    """With pvegpu removed the guard still refuses pre-start and names `pct set 129 --delete hookscript` as the way out."""
    guard = _guard_copy(tmp_path, str(tmp_path / "opt" / "pvegpu" / "bin" / "pvegpu"))
    r = subprocess.run([guard, "129", phase], capture_output=True, text=True, env={"PATH": "/sbin:/bin:/usr/sbin:/usr/bin", "LC_ALL": "C"},
                       stdin=subprocess.DEVNULL, timeout=10)
    assert r.returncode == code and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "pct set 129 --delete hookscript" in r.stderr and "qm set 129 --delete hookscript" in r.stderr
    assert "reinstall pvegpu" in r.stderr


# -- item 10: the maintainer scripts print nothing raw ------------------------------------------------------------------

OLD_GUARD = """#!/bin/sh
# pvegpu start gate for Proxmox VE containers (an older pvegpu's text)
PVEGPU=/opt/pvegpu/bin/pvegpu
exec "$PVEGPU" hook "$1" "$2"
"""
ESC = "\x1b]0;owned\x07\x1b[2J"  # set the terminal's title, clear the screen


def test_postinst_prints_storage_paths_from_storage_cfg_escaped(tmp_path):
    """postinst names a storage path holding escape sequences escaped (\\x1b), never raw, and still refreshes its guard."""
    vz = tmp_path / f"vz{ESC}"
    (vz / "snippets").mkdir(parents=True)
    for d in (vz, vz / "snippets"):
        d.chmod(0o755)
    (vz / "snippets" / "pvegpu-guard").write_text(OLD_GUARD)
    (vz / "snippets" / "pvegpu-guard").chmod(0o755)
    pve = etc_pve(str(tmp_path / "pve"), "pve1", {129: GPU_CONF + GUARD_LINE})
    with open(os.path.join(pve, "storage.cfg"), "w") as f:
        f.write(f"dir: local\n\tpath {vz}\n\tcontent snippets\n")
    script = tmp_path / "postinst"
    script.write_text(open(os.path.join(PACKAGING, "debian", "postinst")).read()
                      .replace("/opt/pvegpu/bin/python3", sys.executable).replace("/etc/pve", pve))
    p = subprocess.run(["sh", str(script), "configure"], capture_output=True, text=True, timeout=120,
                       env={"PATH": os.environ["PATH"], "LC_ALL": "C.UTF-8"})
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stderr and "\x07" not in p.stderr and "pvegpu: rewrote " in p.stderr, repr(p.stderr)
    assert "\\x1b]0;owned\\x07\\x1b[2J" in p.stderr, p.stderr
    assert (vz / "snippets" / "pvegpu-guard").read_text() == ins.guard_text(ins.template())


def test_postinst_refresh_escapes_what_it_cannot_load_too(tmp_path, monkeypatch):
    """An error in postinst's refresh is one escaped line and exit 1, never a traceback or a raw control character."""
    import io

    def boom(_root: str) -> ins.Plan:
        raise ValueError(f"bad path {ESC}")

    monkeypatch.setattr(ins, "refresh", boom)
    err = io.StringIO()
    assert ins.postinst_refresh(str(tmp_path), err) == 1
    assert err.getvalue() == "pvegpu: ValueError: bad path \\x1b]0;owned\\x07\\x1b[2J\n"


def test_prerm_prints_only_digit_vmids_and_names_the_way_out(tmp_path):
    """prerm names guarded guests by digit vmids only (no raw file name) and the way out `pct set VMID --delete hookscript`."""
    from tests.test_packaging import _prerm

    pve = tmp_path / "pve"
    local = pve / "nodes" / "pve1"
    for sub in ("lxc", "qemu-server"):
        (local / sub).mkdir(parents=True)
    (pve / "local").symlink_to(local)
    (local / "lxc" / "129.conf").write_text(GUARD_LINE)
    (local / "lxc" / f"1{ESC}.conf").write_text(GUARD_LINE)
    p = _prerm(tmp_path, pve)
    assert p.returncode == 0 and "guests still guarded: CT 129" in p.stderr, p.stderr
    assert "\x1b" not in p.stderr and "\x07" not in p.stderr, repr(p.stderr)
    assert "`pct set VMID --delete hookscript`" in p.stderr


# -- item 15: advice and figures ---------------------------------------------------------------------------------------


def test_audit_advice_names_installed_paths_never_a_checkout_path():
    """No audit advice points at a checkout path; missing device nodes name the unit and where the .deb installs it."""
    assert not [k for k, text in ADVICE.items() if "contrib/" in text]
    advice = ADVICE[FlagKind.MISSING_NODE]
    assert "systemctl enable pvegpu-nvidia-nodes.service" in advice and "/usr/lib/systemd/system" in advice


LEAK = {"node": "pve-sim", "gpus": [{"minor": 0, "index": 0, "name": "Simulated H200", "total_mib": 143771}],
        "containers": [{"vmid": 129, "name": "llm129", "status": "running", "gpus": [0],
                        "workloads": [{"kind": "simple", "gpu": 0, "mib": 1024, "leak": True}]}]}


def test_a_reset_screen_shows_every_mib_figure_in_one_format(tmp_path):
    """The leak reset (exit 7) writes every MiB figure alike (1,024 MiB) and says what the leak's figure is of."""
    node = sc.build(LEAK, str(tmp_path / "node"))
    try:
        r = _pvegpu("--simulate", node.root, "reset", "129", "--timeout", "1.5", "--grace", "1", timeout=90)
    finally:
        node.teardown()
    assert r.returncode == 7, r.stdout + r.stderr
    figures = re.findall(r"(\d[\d,]*) MiB", r.stdout)
    assert figures and all(re.fullmatch(r"\d{1,3}(,\d{3})*", f) for f in figures), figures
    assert "1,024 MiB" in r.stdout and re.search(r"still has [\d,]+ MiB \(of 1,024 MiB used\)", r.stdout.replace("\n      ", " ")), r.stdout
