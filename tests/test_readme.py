"""The README's two set-up commands: CI runs the test command byte-identical with no sudo shim, and both work as
root with no sudo installed and as a user through sudo (run with stub apt-get, sudo, python3 and venv tools)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.pvelike import REPO

LOG_STUB = '#!/bin/sh\necho "$(basename "$0") uid=$(id -u) $*" >> "$README_LOG"\n'
SUDO_STUB = LOG_STUB + 'exec "$@"\n'
PY_STUB = LOG_STUB + 'mkdir -p .venv/bin\nfor t in pip python pvegpu; do printf \'%s\' "$STUB_TEXT" > .venv/bin/$t; chmod 755 .venv/bin/$t; done\n'


def readme_commands() -> list[str]:
    lines = open(os.path.join(REPO, "README.md"), encoding="utf-8").read().splitlines()
    return [ln.strip() for ln in lines if "apt-get install" in ln and "python3 -m venv .venv" in ln and ln.startswith("    ")]


def test_ci_runs_the_readme_test_command_verbatim_without_sudo_shim():
    """.ci/run holds the README's test command byte-identical and defines no sudo function."""
    cmds = readme_commands()
    assert len(cmds) == 2
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read()
    assert cmds[1] in ci.splitlines() and "pytest" in cmds[1]
    assert "sudo()" not in ci and "sudo ()" not in ci and "alias sudo" not in ci


@pytest.fixture
def open_dir():
    """A private directory an unprivileged user can enter (pytest's tmp_path parents are root-only)."""
    import pathlib
    import tempfile

    d = tempfile.mkdtemp(prefix="pvegpu-readme-")
    os.chmod(d, 0o755)
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _sandbox(tmp_path, with_sudo: bool):
    """A PATH of stubs: apt-get and python3 log their uid and argv; sudo (only when asked) logs and execs."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name in ("apt-get", "python3"):
        (bin_ / name).write_text(PY_STUB if name == "python3" else LOG_STUB)
    if with_sudo:
        (bin_ / "sudo").write_text(SUDO_STUB)
    for p in bin_.iterdir():
        p.chmod(0o755)
    for tool in ("sh", "id", "basename", "mkdir", "chmod", "printf", "echo", "cat"):
        real = next((os.path.join(d, tool) for d in ("/usr/bin", "/bin") if os.path.exists(os.path.join(d, tool))), None)
        if real and not (bin_ / tool).exists():
            (bin_ / tool).symlink_to(real)
    work = tmp_path / "checkout"
    work.mkdir()
    log = tmp_path / "log"
    log.touch()
    for p in (tmp_path, bin_, work):
        p.chmod(0o755)
    log.chmod(0o666)
    env = {"PATH": str(bin_), "README_LOG": str(log), "STUB_TEXT": LOG_STUB, "HOME": str(tmp_path)}
    return work, log, env


@pytest.mark.parametrize("which", [0, 1])
def test_readme_command_as_root_without_sudo(open_dir, which):
    """As root with no sudo on PATH (a PVE node), each README command runs apt-get as root and goes on to the end."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    work, log, env = _sandbox(open_dir, with_sudo=False)
    cmd = readme_commands()[which]
    r = subprocess.run(["sh", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    lines = log.read_text().splitlines()
    assert lines[0].startswith("apt-get uid=0 update") and lines[1].startswith("apt-get uid=0 install")
    assert lines[-1].startswith(("pvegpu uid=0 demo", "python uid=0 -m pytest"))


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged user needs root")
@pytest.mark.parametrize("which", [0, 1])
def test_readme_command_as_user_goes_through_sudo(open_dir, which):
    """As an unprivileged user, each README command calls apt-get through sudo and the rest as the user."""
    work, log, env = _sandbox(open_dir, with_sudo=True)
    cmd = readme_commands()[which]
    os.chown(work, 65534, 65534)
    r = subprocess.run([shutil.which("setpriv") or "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c", cmd], cwd=work, env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "sudo uid=65534 apt-get update -qq" and lines[2].startswith("sudo uid=65534 apt-get install -y python3-venv")
    assert lines[-1].startswith(("pvegpu uid=65534 demo", "python uid=65534 -m pytest"))
