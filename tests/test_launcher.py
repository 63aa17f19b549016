"""packaging/launcher.py: the .deb's /opt/pvegpu/bin/pvegpu (interpreter -IS, site-packages named) behaves as pip's
console script: same output, same exit codes, every command; it refuses what it could not honour (a .pth file)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig

import pytest

from tests.pvelike import REPO

LAUNCHER = os.path.join(REPO, "packaging", "launcher.py")
SITE = sysconfig.get_path("purelib")


def _write(out, *args):
    return subprocess.run([sys.executable, LAUNCHER, str(out), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def launcher(tmp_path):
    """A launcher for this checkout (first) and this venv's site-packages (its editable .pth is not needed then)."""
    out = tmp_path / "bin" / "pvegpu"
    out.parent.mkdir()
    p = _write(out, "--path", REPO, "--ignore-pth")
    assert p.returncode == 0, p.stderr
    return str(out)


def _run(argv, env=None):
    e = dict(os.environ, PVEGPU_PVE_ROOT="/nonexistent-pve-root", **(env or {}))
    p = subprocess.run(argv, capture_output=True, text=True, env=e, cwd="/", timeout=120)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("args", [
    ["--version"],
    ["reset", "129", "--json"],  # not a PVE node: exit 3, a pvegpu-error document
    ["reset", "129", "--bogus"],  # a bad command line: exit 2 through typer
    ["check"],
    ["hook", "--help"],
    ["--help"],
])
def test_launcher_answers_as_python_m_pvegpu(launcher, args):
    """Same exit code, stdout and stderr as `python -m pvegpu` for each command line."""
    mine = _run([launcher, *args])
    ref = _run([sys.executable, "-m", "pvegpu", *args], env={"PYTHONPATH": REPO})
    assert mine == ref


def test_launcher_is_isolated_and_skips_site(launcher):
    """Its #! line runs this interpreter with -IS, and a PYTHONPATH naming another pvegpu is ignored."""
    with open(launcher) as f:
        assert f.readline().strip() == f"#!{os.path.abspath(sys.executable)} -IS"
    rc, out, _ = _run([launcher, "--version"], env={"PYTHONPATH": "/nonexistent"})
    assert rc == 0 and out.startswith("pvegpu ")


def test_launcher_names_the_site_dirs_after_the_checkout(launcher):
    """sys.path gets the --path directories first, then this interpreter's site-packages."""
    text = open(launcher).read()
    assert f"sys.path.extend({[REPO, SITE]!r})" in text


def _module():
    spec = importlib.util.spec_from_file_location("pvegpu_launcher", LAUNCHER)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _site_dir(tmp_path, *pth):
    d = tmp_path / "site-packages"
    (d / "pvegpu").mkdir(parents=True)
    (d / "pvegpu" / "__main__.py").write_text("")
    for name in pth:
        (d / name).write_text("/somewhere\n")
    return d


def test_launcher_refuses_a_site_dir_with_pth_files(tmp_path, monkeypatch, capsys):
    """A .pth file would not run without site: the launcher is not written (exit 2, one line naming it)."""
    mod = _module()
    monkeypatch.setattr(mod.site, "getsitepackages", lambda: [str(_site_dir(tmp_path, "extra.pth"))])
    assert mod.main([str(tmp_path / "pvegpu")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "extra.pth" in err and not (tmp_path / "pvegpu").exists()


def test_launcher_for_a_clean_site_dir_names_it(tmp_path, monkeypatch):
    """A site dir without .pth files: the launcher is written, naming it on sys.path."""
    mod = _module()
    d = _site_dir(tmp_path)
    monkeypatch.setattr(mod.site, "getsitepackages", lambda: [str(d), str(tmp_path / "missing")])
    assert mod.main([str(tmp_path / "pvegpu")]) == 0
    assert f"sys.path.extend({[str(d)]!r})" in (tmp_path / "pvegpu").read_text()


def test_launcher_refuses_paths_without_pvegpu(tmp_path, monkeypatch, capsys):
    """No pvegpu package on the named paths nor in the site dirs: exit 2, nothing written."""
    mod = _module()
    monkeypatch.setattr(mod.site, "getsitepackages", lambda: [])
    assert mod.main([str(tmp_path / "pvegpu"), "--path", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("launcher.py: ") and not (tmp_path / "pvegpu").exists()
