"""The .deb's pieces that run here: the man page and bash completion generated from the CLI, the files a venv
install ships (package data), one version, the guard refresh run by the postinst, the maintainer scripts' syntax and
their bounds (postinst under timeout(1), prerm within 10 s on a hung /etc/pve).
(The .deb itself is built, installed, upgraded and purged in chroots by packaging/ci-deb, run by .ci/run.)"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import zipfile

import pytest

from pvegpu import __version__
from pvegpu.cli import install as ins
from tests.pvelike import REPO, etc_pve

PACKAGING = os.path.join(REPO, "packaging")


def _clidoc():
    spec = importlib.util.spec_from_file_location("clidoc", os.path.join(PACKAGING, "clidoc.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["clidoc"] = mod
    spec.loader.exec_module(mod)
    return mod


def _cli_commands() -> set[str]:
    """Every command path of the typer app, read independently of clidoc."""
    import typer.main

    from pvegpu.cli.app import app

    out: set[str] = set()

    def walk(c, path):
        for name, sub in getattr(c, "commands", {}).items():
            if not getattr(sub, "hidden", False):
                out.add(" ".join(path + [name]))
                walk(sub, path + [name])

    walk(typer.main.get_command(app), [])
    return out


def test_man_page_names_every_command_and_option():
    """The generated man page has a section for every command of the CLI, every visible option, and the README's exit codes."""
    doc = _clidoc()
    text = doc.man(__version__, os.path.join(REPO, "README.md"), date="2026-01-01")
    sections = {m.group(1).replace("\\-", "-") for m in re.finditer(r"^\.SS pvegpu ((?:[a-z\\-]+ ?)+?)(?: [A-Z\[]|$)", text, re.M)}
    assert _cli_commands() - {"hook"} <= sections, _cli_commands() - sections
    assert "hook" in sections  # `pvegpu hook VMID PHASE`, as PVE calls it
    for c in doc.all_commands(doc.commands()):
        for names, _meta, _help in c.options:
            for n in names.split(", "):
                assert n.replace("-", "\\-") in text, n
    assert re.search(r'^\.TH PVEGPU 1 "2026-01-01" "pvegpu ' + re.escape(__version__), text, re.M)
    codes = [c for c, _ in doc.exit_codes(os.path.join(REPO, "README.md"))]
    assert {"0", "2", "8", "10", "128+n"} <= set(codes)
    assert ".SH EXIT STATUS" in text


def test_man_page_renders_without_warnings(tmp_path):
    """groff reads the generated page without a warning (skipped where man/groff is not installed)."""
    if not shutil.which("groff"):
        pytest.skip("groff not installed")
    page = tmp_path / "pvegpu.1"
    page.write_text(_clidoc().man(__version__, os.path.join(REPO, "README.md")))
    p = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", str(page)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr


def test_man_page_and_completion_know_check_wide(tmp_path):
    """`pvegpu check --wide/-v` is in the man page's check section and offered by bash completion."""
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


@pytest.fixture(scope="module")
def completion(tmp_path_factory):
    d = tmp_path_factory.mktemp("completion")
    script = d / "pvegpu.bash"
    script.write_text(_clidoc().completion())
    vmlist = d / ".vmlist"
    vmlist.write_text('{"version": 7, "ids": {"129": {"node": "pve1", "type": "lxc", "version": 3},\n'
                      '"130": { "node": "pve1", "type": "lxc", "version": 1 }, "200": {"node": "pve2", "type": "qemu", "version": 2}}}\n')

    def complete(*words: str) -> list[str]:
        """COMPREPLY for ``pvegpu WORDS...`` (the last word is the one being completed)."""
        arr = " ".join("'" + w.replace("'", "'\\''") + "'" for w in ("pvegpu",) + words)
        prog = f"source {script}; COMP_WORDS=({arr}); COMP_CWORD={len(words)}; _pvegpu; printf '%s\\n' \"${{COMPREPLY[@]}}\""
        p = subprocess.run(["bash", "--norc", "--noprofile", "-c", prog], capture_output=True, text=True, timeout=30,
                           env={"PATH": os.environ["PATH"], "PVEGPU_VMLIST": str(vmlist)}, cwd=d)
        assert p.returncode == 0, p.stderr
        return [w for w in p.stdout.splitlines() if w]

    return complete


def test_completion_offers_every_command(completion):
    """At the top, completion offers every top-level command of the CLI and the global options."""
    top = {c.split()[0] for c in _cli_commands()}
    got = set(completion(""))
    assert top <= got and {"--config", "--version", "--help"} <= got


def test_completion_vmids_from_vmlist(completion):
    """A VMID argument completes from /etc/pve/.vmlist (whitespace as pmxcfs writes it or not), also after options."""
    assert completion("reset", "") == ["129", "130", "200"]
    assert completion("reset", "13") == ["130"]
    assert completion("--config", "/x", "check", "1") == ["129", "130"]
    assert completion("reset", "--timeout", "5", "") == ["129", "130", "200"]
    assert completion("hook", "install", "2") == ["200"]


def test_completion_hook_subcommands_phases_and_options(completion):
    """`hook` offers its subcommands and VMIDs; `hook VMID` the phases; options per command; no VMIDs where none is taken."""
    assert {"install", "uninstall", "status", "allow-once", "129"} <= set(completion("hook", ""))
    assert completion("hook", "129", "pre") == ["pre-start", "pre-stop"]
    assert {"--dry-run", "--no-restart", "--timeout", "--json"} <= set(completion("reset", "129", "--"))
    assert completion("audit", "") == []
    assert completion("reset", "--timeout", "") == []  # a number: nothing to offer


def test_completion_sim_subcommands_and_their_options(completion):
    """`sim` offers its subcommands (create, remove), not VMIDs; `sim create --` its own options."""
    assert completion("sim", "") == ["create", "remove"]
    assert "--scenario" in completion("sim", "create", "--") and completion("sim", "create", "") == []


def test_completion_without_vmlist(tmp_path):
    """Off a PVE node (no .vmlist) a VMID completes to nothing, without an error."""
    script = tmp_path / "c.bash"
    script.write_text(_clidoc().completion())
    prog = f"source {script}; COMP_WORDS=(pvegpu reset ''); COMP_CWORD=2; _pvegpu; echo n=${{#COMPREPLY[@]}}"
    p = subprocess.run(["bash", "--norc", "-c", prog], capture_output=True, text=True, timeout=30,
                       env={"PATH": os.environ["PATH"], "PVEGPU_VMLIST": str(tmp_path / "none")})
    assert p.returncode == 0 and p.stdout.strip() == "n=0" and not p.stderr


def test_completion_after_simulate_offers_the_simulated_nodes_vmids(tmp_path):
    """`pvegpu --simulate DIR reset <TAB>` completes DIR's VMIDs (DIR/etc-pve/.vmlist), not the real node's."""
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


def test_package_data_copies_equal_contrib():
    """The units and alert rules inside the package (a venv install has them) are contrib's, byte for byte."""
    for sub, names in (("systemd", os.listdir(os.path.join(REPO, "contrib", "systemd"))), ("prometheus", ["pvegpu.rules.yml"])):
        shipped = sorted(f for f in os.listdir(os.path.join(REPO, "pvegpu", "data", sub)))
        assert shipped == sorted(names)
        for n in names:
            a = open(os.path.join(REPO, "contrib", sub, n), "rb").read()
            assert a == open(os.path.join(REPO, "pvegpu", "data", sub, n), "rb").read(), n


def test_wheel_ships_contrib_and_one_version(tmp_path):
    """The wheel a venv install gets holds the guard, the units and the alert rules, and its version is __version__."""
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ and egg-info in the checkout
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, f), src / f)
    shutil.copytree(os.path.join(REPO, "pvegpu"), src / "pvegpu", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    if p.returncode != 0 and re.search(r"No matching distribution|Could not fetch|NewConnectionError|Network is unreachable", p.stderr):
        pytest.skip("pip cannot fetch setuptools for the build (no index reachable)")
    assert p.returncode == 0, p.stderr
    (whl,) = [f for f in os.listdir(out) if f.endswith(".whl")]
    assert whl.startswith(f"pvegpu-{__version__}-")
    names = set(zipfile.ZipFile(out / whl).namelist())
    for f in ("pvegpu/data/pvegpu-guard", "pvegpu/data/prometheus/pvegpu.rules.yml", "pvegpu/data/systemd/pvegpu-audit.service",
              "pvegpu/data/systemd/pvegpu-audit.timer", "pvegpu/data/systemd/pvegpu-nvidia-nodes.service"):
        assert f in names, f


def test_version_has_one_source():
    """pyproject.toml takes the version from pvegpu.__version__ (no second copy to forget)."""
    text = open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8").read()
    assert re.search(r'^dynamic = \["version"\]', text, re.M) and 'version = {attr = "pvegpu.__version__"}' in text
    assert not re.search(r'^version = "', text, re.M)
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


def test_maintainer_scripts_parse():
    """postinst, prerm and postrm are valid POSIX sh (dash), and the build and CI scripts valid bash."""
    for name in ("postinst", "prerm", "postrm"):
        path = os.path.join(PACKAGING, "debian", name)
        assert os.stat(path).st_mode & stat.S_IXUSR
        sh = shutil.which("dash") or "sh"
        assert subprocess.run([sh, "-n", path], capture_output=True, timeout=30).returncode == 0, name
    for name in ("build-deb", "ci-deb", "ci-user-run", "ci-lib.sh"):
        assert subprocess.run(["bash", "-n", os.path.join(PACKAGING, name)], capture_output=True, timeout=30).returncode == 0, name


def test_postinst_runs_its_refresh_and_its_etc_pve_probe_under_timeout():
    """The postinst cannot hang apt: its /etc/pve probe and the refresh run under timeout(1), and a timeout still exits 0."""
    text = open(os.path.join(PACKAGING, "debian", "postinst"), encoding="utf-8").read()
    body = text.split("configure)", 1)[1]
    lines = [ln.strip() for ln in body.splitlines()]
    runs = [ln for ln in lines if "/opt/pvegpu/bin/python3" in ln or (ln.startswith("if ") and "/etc/pve" in ln)]
    assert len(runs) == 2 and all(re.match(r"(if )?timeout (-k \d+ )?\d+ ", ln) for ln in runs), runs
    assert "|| echo" in body and text.rstrip().endswith("exit 0")


def test_build_deb_refuses_bad_arguments():
    """build-deb: no release or an unknown one is exit 2 with one line, before anything is built."""
    for args in ([], ["--release", "sid"], ["--bogus"]):
        p = subprocess.run(["bash", os.path.join(PACKAGING, "build-deb"), *args], capture_output=True, text=True, timeout=30)
        assert p.returncode == 2 and p.stderr.startswith("build-deb: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr


# -- the postinst's guard refresh ---------------------------------------------------------------------------

OLD_GUARD_BODY = """#!/bin/sh
# pvegpu start gate for Proxmox VE containers (an older pvegpu's text)
PVEGPU=/opt/pvegpu/bin/pvegpu
PVEGPU_PYTHON=/opt/pvegpu/bin/python3
PVEGPU_PYTHONPATH=/opt/pvegpu/lib/python3.11/site-packages
exec "$PVEGPU" hook "$1" "$2"
"""


@pytest.fixture
def node(tmp_path):
    vz, other = tmp_path / "vz", tmp_path / "fast"
    for d in (vz, other):
        (d / "snippets").mkdir(parents=True)
        d.chmod(0o755)
        (d / "snippets").chmod(0o755)
    pve = etc_pve(str(tmp_path / "pve"), "pve1", {129: "dev0: /dev/nvidia0\nhookscript: fast:snippets/pvegpu-guard\n",
                                                  130: "dev0: /dev/nvidia0\n"})
    with open(os.path.join(pve, "storage.cfg"), "w") as f:
        f.write(f"dir: local\n\tpath {vz}\n\tcontent snippets\n\ndir: fast\n\tpath {other}\n\tcontent snippets\n")
    return pve, vz / "snippets" / "pvegpu-guard", other / "snippets" / "pvegpu-guard"


def _write(path, text, mode=0o755):
    path.write_text(text)
    path.chmod(mode)


def test_refresh_rewrites_guards_an_older_pvegpu_wrote(node):
    """After an upgrade (or a Python change), every guard pvegpu wrote, on local and on the storages containers name,
    is rewritten to what `hook install` writes now; no container config changes."""
    pve, local, fast = node
    _write(local, OLD_GUARD_BODY)
    _write(fast, OLD_GUARD_BODY)
    before = open(os.path.join(pve, "nodes", "pve1", "lxc", "129.conf")).read()
    plan = ins.refresh(pve)
    want = ins.guard_text(ins.template())
    assert plan.ok and len(plan.done) == 2
    assert local.read_text() == want and fast.read_text() == want
    assert stat.S_IMODE(local.stat().st_mode) == 0o755
    assert ins.guard_problem(str(local), want) is None
    assert open(os.path.join(pve, "nodes", "pve1", "lxc", "129.conf")).read() == before
    assert ins.refresh(pve).done == []  # already current: nothing rewritten


def test_refresh_leaves_what_pvegpu_did_not_write(node):
    """A snippet named pvegpu-guard that is not pvegpu's text, is writable by others, or is a symlink is left alone and named."""
    pve, local, fast = node
    _write(local, "#!/bin/sh\n# the admin's own script\nexit 0\n")
    _write(fast, OLD_GUARD_BODY, 0o777)
    plan = ins.refresh(pve)
    assert plan.done == [] and len(plan.warnings) == 2
    assert local.read_text().startswith("#!/bin/sh\n# the admin's") and fast.read_text() == OLD_GUARD_BODY
    fast.unlink()
    target = fast.parent / "elsewhere"
    _write(target, OLD_GUARD_BODY)
    fast.symlink_to(target)
    plan = ins.refresh(pve)
    assert plan.done == [] and any(str(fast) in w for w in plan.warnings) and target.read_text() == OLD_GUARD_BODY


def test_refresh_without_guards_does_nothing(node):
    """A node where `hook install` never ran: refresh writes nothing."""
    pve, local, fast = node
    plan = ins.refresh(pve)
    assert plan.ok and plan.done == [] and plan.warnings == [] and not local.exists() and not fast.exists()


def test_readme_install_section_names_this_version_and_one_venv_command():
    """The install section's .deb command names this version for both releases, and it holds exactly one
    venv-from-checkout line, the one packaging/ci-deb runs verbatim in fresh chroots."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    sec = text.split("## Install on a PVE node", 1)[1].split("\n## ", 1)[0]
    assert f"    apt install ./pvegpu_{__version__}_bookworm_amd64.deb" in sec and f"./pvegpu_{__version__}_trixie_amd64.deb" in sec
    venv = [ln for ln in text.splitlines() if re.fullmatch(r"    apt-get update.*python3 -m venv /opt/pvegpu.*", ln)]
    assert len(venv) == 1 and "pip install -q ." in venv[0]


def test_deb_takes_its_settings_example_from_the_settings_page_and_ships_docs():
    """build-deb's awk line turns docs/settings.md's TOML block into pvegpu.toml.example, and the package ships docs/."""
    if not shutil.which("awk"):
        pytest.skip("awk not installed")
    script = open(os.path.join(PACKAGING, "build-deb"), encoding="utf-8").read()
    m = re.search(r"^awk '([^']*)' \"\$S/docs/settings.md\"", script, re.M)
    assert m, "build-deb no longer reads docs/settings.md"
    out = subprocess.run(["awk", m.group(1), os.path.join(REPO, "docs", "settings.md")], capture_output=True, text=True, timeout=30)
    page = open(os.path.join(REPO, "docs", "settings.md"), encoding="utf-8").read()
    assert out.returncode == 0 and out.stdout.startswith('node = ""') and out.stdout in page and "[leftover]" in out.stdout
    assert re.search(r"^tar .* docs .*\|", script, re.M) and '"$S"/docs/*.md' in script


def test_refresh_rewrites_the_guard_on_a_storage_only_a_vm_names(node):
    """A storage named only by a VM's hookscript (qemu-server/*.conf) is refreshed too, not only containers' storages."""
    pve, local, fast = node
    os.unlink(os.path.join(pve, "nodes", "pve1", "lxc", "129.conf"))
    os.makedirs(os.path.join(pve, "nodes", "pve1", "qemu-server"), exist_ok=True)
    with open(os.path.join(pve, "nodes", "pve1", "qemu-server", "200.conf"), "w") as f:
        f.write("hostpci0: 0000:01:00.0\nhookscript: fast:snippets/pvegpu-guard\n")
    _write(fast, OLD_GUARD_BODY)
    plan = ins.refresh(pve)
    assert plan.ok and fast.read_text() == ins.guard_text(ins.template())


def test_prerm_names_this_nodes_guarded_containers_and_vms_only(tmp_path):
    """prerm names this node's guests whose current config runs the guard (CTs and VMs); a guard only in a snapshot
    section, or on another node, is not named."""
    pve = tmp_path / "pve"
    local = pve / "nodes" / "pve1"
    for sub in ("lxc", "qemu-server"):
        (local / sub).mkdir(parents=True)
        (pve / "nodes" / "pve2" / sub).mkdir(parents=True)
    (pve / "local").symlink_to(local)
    guard = "hookscript: local:snippets/pvegpu-guard\n"
    (local / "lxc" / "129.conf").write_text("arch: amd64\n" + guard)
    (local / "lxc" / "130.conf").write_text("arch: amd64\n\n[snap1]\n" + guard)  # only an old snapshot had it
    (local / "qemu-server" / "200.conf").write_text("hostpci0: 0000:01:00.0\n" + guard + "\n[snap]\nmemory: 1\n")
    (pve / "nodes" / "pve2" / "lxc" / "140.conf").write_text(guard)  # another node's container
    p = _prerm(tmp_path, pve)
    assert p.returncode == 0, p.stderr
    named = p.stderr.splitlines()[0]
    assert "CT 129" in named and "VM 200" in named and "130" not in named and "140" not in named, p.stderr


def _prerm(tmp_path, pve, hang: bool = False) -> subprocess.CompletedProcess[str]:
    """prerm remove with /etc/pve at ``pve``, its 10 s bound at 1 s, no systemctl (the units are left alone);
    ``hang``: every read of a config never returns (a cluster filesystem that hangs)."""
    script = tmp_path / "prerm"
    script.write_text(open(os.path.join(PACKAGING, "debian", "prerm")).read().replace("/etc/pve", str(pve))
                      .replace("timeout -k 2 10 ", "timeout -k 1 1 "))
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    for t in ("sed", "grep", "tr", "cat", "sh", "timeout", "sleep", "mktemp", "rm"):
        if not (tools / t).exists():
            (tools / t).symlink_to(shutil.which(t))
    if hang:
        (tools / "sed").unlink()
        (tools / "sed").write_text("#!/bin/sh\nexec sleep 60\n")
        (tools / "sed").chmod(0o755)
    return subprocess.run([shutil.which("sh"), str(script), "remove"], capture_output=True, text=True, timeout=30,
                          env={"PATH": str(tools)})


def test_prerm_never_waits_on_a_hung_etc_pve(tmp_path):
    """A cluster filesystem whose reads never return holds the removal for the bound only: prerm exits 0 within it and
    says that which guests are still guarded is not known (never that none are)."""
    import time

    local = tmp_path / "pve" / "nodes" / "pve1"
    (local / "lxc").mkdir(parents=True)
    (tmp_path / "pve" / "local").symlink_to(local)
    (local / "lxc" / "129.conf").write_text("hookscript: local:snippets/pvegpu-guard\n")
    t = time.monotonic()
    p = _prerm(tmp_path, tmp_path / "pve", hang=True)
    assert p.returncode == 0 and time.monotonic() - t < 10, p.stderr
    assert "not known" in p.stderr and "still guarded" not in p.stderr


def test_prerm_is_bounded_when_the_hung_reader_survives_timeouts_kill(tmp_path):
    """A reader of /etc/pve stuck past SIGKILL (pmxcfs hung, D state) holding prerm's pipe: prerm still ends within 10 s."""
    import time

    local = tmp_path / "pve" / "nodes" / "pve1"
    (local / "lxc").mkdir(parents=True)
    (tmp_path / "pve" / "local").symlink_to(local)
    (local / "lxc" / "129.conf").write_text("hookscript: local:snippets/pvegpu-guard\n")
    tools = tmp_path / "bin"
    tools.mkdir()
    # the inner `sh -c "$scan"` is this stand-in: what it leaves holding stdout outlives timeout's TERM and KILL,
    # as the inner shell itself does when its stat/readdir of /etc/pve is stuck in uninterruptible sleep
    (tools / "sh").write_text(f"#!/bin/sh\n{shutil.which('setsid')} {shutil.which('sleep')} 15 &\nexec {shutil.which('sleep')} 15\n")
    (tools / "sh").chmod(0o755)
    t = time.monotonic()
    p = _prerm(tmp_path, tmp_path / "pve")
    took = time.monotonic() - t
    assert p.returncode == 0 and took < 10, (took, p.stderr)
    assert "not known" in p.stderr


def test_license_is_mit_and_the_deb_copyright_carries_its_text():
    """The checkout has the MIT LICENSE the package metadata claims, and build-deb puts its text into the .deb's copyright."""
    text = open(os.path.join(REPO, "LICENSE"), encoding="utf-8").read()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the pvegpu developers" in text
    assert "Permission is hereby granted, free of charge" in text
    build = open(os.path.join(PACKAGING, "build-deb"), encoding="utf-8").read()
    assert '"$S/LICENSE"' in build and "Copyright: 2026 the pvegpu developers" in build


# -- build-deb's package tree -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deb_tree(tmp_path_factory):
    """build-deb's "package tree" step run on a stand-in build chroot: the checkout's files as build-deb copies them,
    a venv as ``python3 -m venv`` leaves it (activate scripts, an empty include/) plus what pip leaves (pip, a
    dependency's console script) and the launcher; the tree the .deb is made of (before its control file)."""
    script = open(os.path.join(PACKAGING, "build-deb"), encoding="utf-8").read()
    section = script.split('step "package tree"\n', 1)[1].split("\nARCH=$(in_chroot", 1)[0]
    files = re.search(r"^tar -C \"\$SRC\" .* -cf - (.*) \| tar", script, re.M)
    assert files, "build-deb no longer copies the source with tar"
    tmp = tmp_path_factory.mktemp("deb")
    build = tmp / "ch" / "tmp" / "pvegpu-build"
    (build / "src").mkdir(parents=True)
    subprocess.run(f"tar -C {shlex.quote(REPO)} --exclude=__pycache__ --exclude='*.egg-info' --exclude=.venv -cf - {files.group(1)}"
                   f" | tar -C {shlex.quote(str(build / 'src'))} -xf -", shell=True, check=True, timeout=120)
    (build / "pvegpu.bash").write_text("complete -F _pvegpu pvegpu\n")
    (build / "pvegpu.1").write_text(".TH PVEGPU 1\n")
    venv = tmp / "ch" / "opt" / "pvegpu"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    for name in ("pip", "pip3", "normalizer", "pvegpu"):
        _write(venv / "bin" / name, "#!/bin/sh\nexit 0\n")
    py = "%d.%d" % sys.version_info[:2]
    env = {"PATH": os.environ["PATH"], "LC_ALL": "C", "CH": str(tmp / "ch"), "B": "/tmp/pvegpu-build", "PY": py,
           "RELEASE": "bookworm", "VERSION": __version__, "REVISION": "1", "DEBV": "deb12"}
    prog = 'set -euo pipefail\ndie() { echo "build-deb: $*" >&2; exit 2; }\nstep() { :; }\n' + section
    p = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    return build / "root", py


def test_deb_ships_the_json_schemas_under_usr_share_pvegpu(deb_tree):
    """The .deb installs every JSON Schema, byte for byte, as /usr/share/pvegpu/schema/<kind>.json."""
    root, _ = deb_tree
    shipped = root / "usr" / "share" / "pvegpu" / "schema"
    kinds = sorted(os.listdir(os.path.join(REPO, "pvegpu", "data", "schema")))
    assert kinds and sorted(os.listdir(shipped)) == kinds
    for k in kinds:
        assert (shipped / k).read_bytes() == open(os.path.join(REPO, "pvegpu", "data", "schema", k), "rb").read(), k
        assert stat.S_IMODE((shipped / k).stat().st_mode) == 0o644


def test_deb_venv_holds_no_activate_scripts_pip_or_other_console_scripts(deb_tree):
    """/opt/pvegpu/bin in the .deb holds the launcher and python links only: no activate scripts, pip or others' scripts."""
    root, py = deb_tree
    assert sorted(os.listdir(root / "opt" / "pvegpu" / "bin")) == sorted({"pvegpu", "python", "python3", f"python{py}"})
    assert not (root / "opt" / "pvegpu" / "include").exists()
    assert (root / "opt" / "pvegpu" / "pyvenv.cfg").is_file()
