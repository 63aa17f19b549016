"""The README and docs/: the README's two set-up commands (CI runs the test command byte-identical with no sudo shim,
and both work as root with no sudo installed and as a user through sudo, run with stub apt-get, sudo, python3 and
venv tools); the documents stay short, their links resolve, and what they state as the contract matches the code."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import tomllib

import pytest

from pvegpu.core import errors
from pvegpu.core.settings import Settings
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


def test_ci_runs_both_readme_commands_as_a_user():
    """CI's one extraction (packaging/ci-lib.sh readme_command) yields exactly the README's two set-up commands, and
    .ci/run runs both as a user on this machine and in a fresh trixie chroot (packaging/ci-user-run)."""
    lib = os.path.join(REPO, "packaging", "ci-lib.sh")
    got = [subprocess.run(["bash", "-c", f'. "$0"; readme_command {which}', lib], capture_output=True, text=True, timeout=30)
           for which in ("demo", "test")]
    assert [g.returncode for g in got] == [0, 0] and [g.stdout.rstrip("\n") for g in got] == readme_commands()
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert "$S packaging/ci-user-run --here" in ci and "$S packaging/ci-user-run trixie" in ci


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


def _read(rel: str) -> str:
    """A file of the checkout, by its path relative to the repository root."""
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
        return f.read()


DOCS = ["README.md", "BENCHMARKS.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_and_benchmarks_stay_short():
    """README.md stays within 25 KB and BENCHMARKS.md within 15 KB; the details live in docs/ and bench/results/."""
    assert len(_read("README.md").encode()) <= 25_000
    assert len(_read("BENCHMARKS.md").encode()) <= 15_000


def test_readme_links_every_topic_page():
    """The README links each page a newcomer needs: failure modes, settings, JSON, Prometheus, VMs, security, the simulated node."""
    readme = _read("README.md")
    for page in ("failure-modes", "settings", "json", "prometheus", "vms", "security", "simulated-node"):
        assert f"](docs/{page}.md" in readme, page
        assert os.path.isfile(os.path.join(REPO, "docs", f"{page}.md")), page


def test_relative_links_and_anchors_resolve():
    """Every relative link in the README, BENCHMARKS.md and docs/ names a file that exists, and a heading there when it has an anchor."""
    for doc in DOCS + ["bench/results/HISTORY.md"]:
        text = _read(doc)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            rel = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            assert os.path.isfile(os.path.join(REPO, rel)), f"{doc}: {target}"
            if anchor:
                heads = {_slug(h) for h in re.findall(r"^#+ (.*)$", _read(rel), re.M)}
                assert anchor in heads, f"{doc}: {target}"


def test_benchmarks_open_with_the_current_figures_and_link_the_history():
    """BENCHMARKS.md's first section is the table of current figures (date, machine, command, against what); the history is linked."""
    text = _read("BENCHMARKS.md")
    first = text.split("\n## ", 2)[1]
    assert first.startswith("Current figures")
    header = next(ln for ln in first.splitlines() if ln.startswith("| "))
    for col in ("date, machine", "command", "against"):
        assert col in header, col
    assert "bench/results/HISTORY.md" in text and os.path.isfile(os.path.join(REPO, "bench", "results", "HISTORY.md"))


def test_exit_code_table_lists_every_exit_code():
    """The README's exit-code table (the contract, and the man page's source) has one row per exit code the code defines, plus 128+n."""
    sec = _read("README.md").split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+|128\+n) \| ", sec, re.M)
    codes = {str(v) for k, v in vars(errors).items() if k.startswith("EXIT_") and isinstance(v, int)}
    assert sorted(rows) == sorted(codes | {"128+n"})


def test_settings_page_lists_every_key_with_its_default():
    """docs/settings.md's TOML block (shipped as pvegpu.toml.example) holds every setting, each at the code's default."""
    block = re.search(r"^```toml\n(.*?)^```", _read("docs/settings.md"), re.M | re.S)
    assert block
    doc = tomllib.loads(block.group(1))
    defaults = Settings()
    for f in dataclasses.fields(defaults):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            assert set(doc[f.name]) == {g.name for g in dataclasses.fields(value)}, f.name
            for g in dataclasses.fields(value):
                want = getattr(value, g.name)
                assert doc[f.name][g.name] == (list(want) if isinstance(want, tuple) else want), f"{f.name}.{g.name}"
        elif f.name != "simulate":  # --simulate DIR / PVEGPU_SIMULATE: a way to run, not a key of a node's file
            assert doc[f.name] == value, f.name


@pytest.mark.parametrize("gone", ["record.py", "`record`", "strenum", "lightjson", "lightargs", "frontdoor", "nvml_lite",
                                  "nvml_warm", "adapters/workers", "anywhere on the line"])
def test_docs_name_no_deleted_stand_in(gone):
    """The README and docs/ describe the product as it is: no module of the deleted stand-ins, no global options after the command."""
    for doc in ["README.md"] + [d for d in DOCS if d.startswith("docs/")]:
        assert gone not in _read(doc), doc
