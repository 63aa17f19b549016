"""`pvegpu hook install | uninstall | status` against a temporary PVE-like tree with stub pct, pvesm and pvesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import pvelike
from tests.pvelike import REPO, etc_pve

GPU_CONF = "arch: amd64\ndev0: /dev/nvidia0,gid=44\n"
STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$STUB_LOG"
if [ "$(basename "$0")" = pct ] && [ "$1" = set ]; then
  conf="$STUB_PVE/nodes/pve1/lxc/$2.conf"
  sed -i '/^hookscript:/d' "$conf"
  [ "$3" = --hookscript ] && echo "hookscript: $4" >> "$conf"
fi
if [ "$(basename "$0")" = pvesh ]; then
  case "$2" in */nodes/pve2/*) echo '[]' ;; *) echo '[{"volid":"local:snippets/pvegpu-guard"}]' ;; esac
fi
exit 0
"""
pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="hook install needs root (as on a PVE node)")]


@pytest.fixture
def tree(tmp_path):
    pve = etc_pve(str(tmp_path / "pve"), "pve1", {129: GPU_CONF, 130: GPU_CONF + "hookscript: local:snippets/mine.pl\n",
                                                  131: "arch: amd64\n"})
    os.makedirs(os.path.join(pve, "nodes", "pve2", "lxc"))
    vz = tmp_path / "vz"
    (vz / "snippets").mkdir(parents=True)
    for d in (vz, vz / "snippets"):
        d.chmod(0o755)  # a snippets directory others may write is refused: never the umask's choice
    (vz / "snippets" / "mine.pl").write_text("#!/bin/sh\nexit 0\n")
    with open(os.path.join(pve, "storage.cfg"), "w") as f:
        f.write(f"dir: local\n\tpath {vz}\n\tcontent iso,vztmpl,backup\n")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name in ("pct", "pvesm", "pvesh"):
        (bin_ / name).write_text(STUB)
        (bin_ / name).chmod(0o755)
    cfg = tmp_path / "pvegpu.toml"
    cfg.write_text(f'pve_root = "{pve}"\nnode = "pve1"\n')
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", STUB_LOG=str(tmp_path / "log"), STUB_PVE=pve, PVEGPU_CONFIG=str(cfg))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "pvegpu", "hook", *args], capture_output=True, text=True, env=env, cwd=REPO)

    def log():
        return (tmp_path / "log").read_text().splitlines() if (tmp_path / "log").exists() else []

    return pve, vz, cli, log


def conf(pve, vmid):
    return open(os.path.join(pve, "nodes", "pve1", "lxc", f"{vmid}.conf")).read()


def test_install_guards_gpu_containers_and_refuses_foreign_hookscript(tree):
    """Install writes the executable snippet, enables snippets, sets the hookscript on the GPU CT, refuses to
    replace CT 130's own hookscript, skips the GPU-less CT, and names the node missing the snippet."""
    pve, vz, cli, log = tree
    r = cli("install")
    assert r.returncode == 8  # CT 130 refused: needs attention (1 is kept for internal errors)
    guard = vz / "snippets" / "pvegpu-guard"
    assert os.access(guard, os.X_OK) and "hook \"$1\" \"$2\"" in guard.read_text()
    from pvegpu.cli.install import pvegpu_path

    assert f"PVEGPU={pvegpu_path()}\n" in guard.read_text() and os.path.isabs(pvegpu_path())
    assert "pvesm set local --content iso,vztmpl,backup,snippets" in log()
    assert "pct set 129 --hookscript local:snippets/pvegpu-guard" in log()
    assert not any("pct set 130" in line or "pct set 131" in line for line in log())
    assert "hookscript: local:snippets/pvegpu-guard" in conf(pve, 129)
    assert "CT 130 already has hookscript local:snippets/mine.pl" in r.stderr and "--chain" in r.stderr
    assert "node pve2 lacks pvegpu-guard" in r.stderr


def test_install_escapes_a_foreign_hookscript_name_with_terminal_controls(tree):
    """A hookscript name in /etc/pve carrying terminal control bytes reaches the admin's terminal escaped."""
    pve, vz, cli, log = tree
    with open(os.path.join(pve, "nodes", "pve1", "lxc", "130.conf"), "w") as f:
        f.write(GPU_CONF + "hookscript: local:snippets/m\x1b]0;owned\x07.pl\n")
    r = cli("install", "130")
    assert r.returncode == 8 and "\x1b" not in r.stderr and "\x07" not in r.stderr and "\\x1b" in r.stderr


def test_chain_then_uninstall_restores_original(tree):
    """--chain runs the guard before the existing script; uninstall puts the original back and removes files."""
    pve, vz, cli, log = tree
    assert cli("install", "130", "--chain").returncode == 0
    chain = vz / "snippets" / "pvegpu-guard-chain-130"
    text = chain.read_text()
    assert f"{vz}/snippets/pvegpu-guard \"$1\" \"$2\" || exit $?" in text and f"exec {vz}/snippets/mine.pl" in text
    assert "pct set 130 --hookscript local:snippets/pvegpu-guard-chain-130" in log()
    r = cli("uninstall", "130")
    assert r.returncode == 0, r.stderr
    assert "pct set 130 --hookscript local:snippets/mine.pl" in log()
    assert not chain.exists() and "hookscript: local:snippets/mine.pl" in conf(pve, 130)


def test_uninstall_all_removes_unused_snippet(tree):
    """Uninstall with no ids unguards every guarded CT and deletes the snippet when nothing uses it."""
    pve, vz, cli, log = tree
    cli("install", "129")
    r = cli("uninstall")
    assert r.returncode == 0, r.stderr
    assert "pct set 129 --delete hookscript" in log()
    assert not (vz / "snippets" / "pvegpu-guard").exists() and "hookscript" not in conf(pve, 129)


def test_status_lists_guarded_unguarded_and_missing_nodes(tree):
    """Status shows each GPU CT's state and the nodes lacking the snippet; exit 1 while anything needs attention."""
    pve, vz, cli, log = tree
    cli("install", "129")
    r = cli("status", "--json")
    st = json.loads(r.stdout)
    states = {row["vmid"]: row["state"] for row in st["containers"]}
    assert states == {129: "guarded", 130: "other hookscript"}
    assert any("pve2" in p for p in st["problems"]) and r.returncode == 8


def test_guard_template_copies_agree():
    """The guard shipped inside the package is the one in contrib/hookscripts."""
    a = open(os.path.join(REPO, "contrib", "hookscripts", "pvegpu-guard")).read()
    b = open(os.path.join(REPO, "pvegpu", "data", "pvegpu-guard")).read()
    assert a == b


def _hostile_tree(tree, name):
    """CT 130's own hookscript renamed to ``name`` (a name PVE's snippet pattern allows); it records its run."""
    pve, vz, cli, log = tree
    marker = vz / "ran"
    script = vz / "snippets" / name
    script.write_text(f"#!/bin/sh\necho \"$1 $2\" >> '{marker}'\nexit 0\n")
    script.chmod(0o755)
    path = os.path.join(pve, "nodes", "pve1", "lxc", "130.conf")
    with open(path, "w") as f:
        f.write(GPU_CONF + f"hookscript: local:snippets/{name}\n")
    return marker


@pytest.mark.parametrize("name", ["my hook.sh", "hook$(id>&2).sh", "a'b\"c`d`.sh", "x;touch PWNED;.sh"])
def test_chain_with_hostile_original_name_runs_it_as_data(tree, name, tmp_path):
    """A chained original whose name has a space, $(...), quotes or ; is run as that file: the start succeeds,
    no command in the name runs; uninstall restores exactly that volid."""
    pve, vz, cli, log = tree
    marker = _hostile_tree(tree, name)
    r = cli("install", "130", "--chain")
    assert r.returncode == 0, r.stderr
    (vz / "snippets" / "pvegpu-guard").write_text("#!/bin/sh\nexit 0\n")  # the gate itself is not under test here
    chain = vz / "snippets" / "pvegpu-guard-chain-130"
    p = subprocess.run([str(chain), "130", "pre-start"], capture_output=True, text=True, cwd=tmp_path, timeout=10,
                       env={"PATH": "/sbin:/bin:/usr/sbin:/usr/bin", "LC_ALL": "C"}, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    assert marker.read_text() == "130 pre-start\n"
    assert "uid=" not in p.stderr and not (tmp_path / "PWNED").exists()
    r = cli("uninstall", "130")
    assert r.returncode == 0, r.stderr
    assert f"hookscript: local:snippets/{name}" in conf(pve, 130)


def test_uninstall_one_keeps_guard_used_by_another_chain(tree):
    """Uninstalling the guard from CT 129 keeps the guard snippet that CT 130's chain script still runs."""
    pve, vz, cli, log = tree
    assert cli("install", "129").returncode == 0
    assert cli("install", "130", "--chain").returncode == 0
    r = cli("uninstall", "129")
    assert r.returncode == 0, r.stderr
    assert (vz / "snippets" / "pvegpu-guard").exists() and (vz / "snippets" / "pvegpu-guard-chain-130").exists()
    assert cli("uninstall", "130").returncode == 0
    assert not (vz / "snippets" / "pvegpu-guard").exists()


def test_install_replaces_planted_symlink_never_writes_through_it(tree, tmp_path):
    """A symlink planted at the guard's or a chain's path is replaced by a new file; its root-only target keeps
    its content and mode."""
    pve, vz, cli, log = tree
    victim = tmp_path / "victim"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    for name in ("pvegpu-guard", "pvegpu-guard-chain-130"):
        (vz / "snippets" / name).symlink_to(victim)
    assert cli("install", "129").returncode == 0
    assert cli("install", "130", "--chain").returncode == 0
    assert victim.read_text() == "secret\n" and (victim.stat().st_mode & 0o777) == 0o600
    for name in ("pvegpu-guard", "pvegpu-guard-chain-130"):
        p = vz / "snippets" / name
        assert not p.is_symlink() and p.is_file() and (p.stat().st_mode & 0o777) == 0o755
    assert not list((vz / "snippets").glob(".*pvegpu-*"))  # no temporary file left


def test_install_without_content_line_keeps_implicit_defaults(tree):
    """A dir storage with no content line has PVE's implicit default (images,rootdir); install adds snippets to
    it instead of replacing it."""
    pve, vz, cli, log = tree
    with open(os.path.join(pve, "storage.cfg"), "w") as f:
        f.write(f"dir: local\n\tpath {vz}\n")
    assert cli("install", "129").returncode == 0
    assert "pvesm set local --content images,rootdir,snippets" in log()


def _guard_with(tmp_path, pvegpu_bin):
    from pvegpu.cli.install import guard_text, template

    g = tmp_path / "guard"
    g.write_text(guard_text(template(), pvegpu_bin, fast=False))
    g.chmod(0o755)
    return g


def test_guard_runs_pvegpu_by_the_absolute_path_install_wrote(tmp_path):
    """The guard runs pvegpu by the absolute path written at install, even with a space in it."""
    d = tmp_path / "my venv" / "bin"
    d.mkdir(parents=True)
    fake = d / "pvegpu"
    fake.write_text("#!/bin/sh\necho \"called $*\"\nexit 0\n")
    fake.chmod(0o755)
    g = _guard_with(tmp_path, str(fake))
    r = subprocess.run([str(g), "129", "pre-start"], capture_output=True, text=True, env={"PATH": "/sbin:/bin:/usr/sbin:/usr/bin", "LC_ALL": "C"},
                       stdin=subprocess.DEVNULL, timeout=10)
    assert r.returncode == 0 and r.stdout == "called hook 129 pre-start\n"


@pytest.mark.parametrize("phase,code", [("pre-start", 10), ("post-start", 0), ("pre-stop", 0), ("post-stop", 0)])
def test_guard_with_missing_pvegpu_refuses_pre_start_with_fix(tmp_path, phase, code):
    """pvegpu missing or not executable at the written path: pre-start refuses (10) with one line saying how to
    fix it; the other phases exit 0."""
    missing = tmp_path / "opt" / "x" / "bin" / "pvegpu"
    g = _guard_with(tmp_path, str(missing))
    r = subprocess.run([str(g), "129", phase], capture_output=True, text=True, env={"PATH": "/sbin:/bin:/usr/sbin:/usr/bin", "LC_ALL": "C"},
                       stdin=subprocess.DEVNULL, timeout=10)
    assert r.returncode == code, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{missing} not found or not executable" in lines[0] and "pvegpu hook install" in lines[0]
    if code:
        assert "refusing to start CT 129" in lines[0]


def test_guard_fast_path_names_pvegpus_and_nvidia_ml_pys_directories():
    """The fast path's import path is pvegpu's directory first, then the one pynvml (nvidia-ml-py, the gate's NVML
    reader) is imported from, each once, ":" between them, shell-quoted in the guard."""
    import importlib.util
    import shlex

    from pvegpu.cli.install import fast_path, guard_text, template

    where = fast_path()
    assert where is not None
    dirs = where.split(":")
    pynvml = os.path.dirname(importlib.util.find_spec("pynvml").origin)  # type: ignore[union-attr, arg-type]
    assert dirs[0] == REPO and pynvml in dirs and len(dirs) == len(set(dirs))
    assert f"\nPVEGPU_PYTHONPATH={shlex.quote(where)}\n" in guard_text(template(), "/usr/bin/pvegpu")


def test_guard_fast_path_runs_the_gate_without_site(tmp_path):
    """The guard's fast path (python -I -S, only its written directories on the path) runs the hook, whose gate
    imports nvidia-ml-py: a phase with nothing to check exits 0, and pynvml is importable that way."""
    from pvegpu.cli.install import fast_path, guard_text, template

    g = tmp_path / "guard"
    g.write_text(guard_text(template(), str(tmp_path / "no-such-pvegpu")))  # only the fast path can answer
    g.chmod(0o755)
    env = {"PATH": "/sbin:/bin:/usr/sbin:/usr/bin", "LC_ALL": "C", "PVEGPU_PVE_ROOT": str(tmp_path / "pve")}
    r = subprocess.run([str(g), "129", "post-start"], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=60)
    assert r.returncode == 0 and "not found" not in r.stderr, r.stderr
    code = "import sys; sys.path[:0] = sys.argv.pop(1).split(':'); import pynvml, pvegpu.adapters.nvml, pvegpu.cli.hook; print('ok')"
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code, fast_path() or ""], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "ok", r.stderr


def test_guard_on_another_storage_is_ours_never_chained_onto_itself(tree, tmp_path):
    """A CT guarded from one snippets storage counts as guarded for another: install there does not chain
    pvegpu's guard onto itself, status says guarded, and uninstall from the other storage takes it off."""
    pve, vz, cli, log = tree
    vz2 = tmp_path / "vz2"
    (vz2 / "snippets").mkdir(parents=True)
    for d in (vz2, vz2 / "snippets"):
        d.chmod(0o755)  # as the tree's storage: a snippets directory others may write is refused
    with open(os.path.join(pve, "storage.cfg"), "a") as f:
        f.write(f"\ndir: snip2\n\tpath {vz2}\n\tcontent snippets\n")
    assert cli("install", "129").returncode == 0
    r = cli("install", "129", "--chain", "--storage", "snip2")
    assert r.returncode == 0 and "already guarded (local:snippets/pvegpu-guard)" in r.stdout, r.stdout + r.stderr
    assert not (vz2 / "snippets" / "pvegpu-guard-chain-129").exists()
    r = cli("status", "--storage", "snip2", "--json")
    assert {"vmid": 129, "state": "guarded", "hookscript": "local:snippets/pvegpu-guard"} in json.loads(r.stdout)["containers"]
    assert cli("uninstall", "129", "--storage", "snip2").returncode == 0
    assert "hookscript" not in conf(pve, 129)


@pytest.mark.parametrize("how", ["user owns snippets", "group-writable snippets", "user owns the storage dir"])
def test_install_refuses_a_snippets_directory_a_user_could_change(tree, how):
    """The guard runs as root at every start: a snippets dir (or one above it) a local user owns or may write is
    refused (exit 2), and neither the guard nor any `pct set` is written."""
    pve, vz, cli, log = tree
    snippets = vz / "snippets"
    if how == "user owns snippets":
        os.chown(snippets, 65534, 65534)
    elif how == "group-writable snippets":
        os.chmod(snippets, 0o775)
    else:
        os.chown(vz, 65534, 65534)
    r = cli("install", "129")
    assert r.returncode == 2 and r.stderr.startswith("Error: ") and "Traceback" not in r.stderr, r.stderr
    assert not (snippets / "pvegpu-guard").exists() and not any(line.startswith("pct") for line in log())


def test_status_calls_a_swapped_guard_not_guarded(tree):
    """After install, the guard replaced by a user who got hold of it, edited, or swapped for a symlink: `hook status`
    says CT 129 is not guarded (exit 8), never 'guarded'."""
    pve, vz, cli, log = tree
    assert cli("install", "129").returncode in (0, 8)
    guard = vz / "snippets" / "pvegpu-guard"
    st = json.loads(cli("status", "--json").stdout)
    assert {r["vmid"]: r["state"] for r in st["containers"]}[129] == "guarded"
    original = guard.read_text()
    os.chown(guard, 65534, 65534)  # a user owns the guard file (a user-owned storage, say) ...
    fd = os.open(vz / "snippets", os.O_RDONLY | os.O_DIRECTORY)

    def swap() -> None:  # ... and rewrites it as that user
        f = os.open("pvegpu-guard", os.O_WRONLY | os.O_TRUNC, dir_fd=fd)
        os.write(f, b"#!/bin/sh\nexit 0\n")
        os.close(f)

    pvelike.as_uid(65534, swap)
    os.close(fd)
    for step in ("user", "edited", "symlink"):
        if step == "edited":
            guard.unlink()
            guard.write_text(original.replace("exit", "true; exit", 1))
            guard.chmod(0o755)
        elif step == "symlink":
            guard.unlink()
            (vz / "snippets" / "elsewhere").write_text(original)
            guard.symlink_to(vz / "snippets" / "elsewhere")
        r = cli("status", "--json")
        st = json.loads(r.stdout)
        assert {row["vmid"]: row["state"] for row in st["containers"]}[129] != "guarded" and r.returncode == 8, step
