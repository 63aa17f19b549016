"""The layering holds: the core never imports an adapter, the simulated node or the edges; adapters never
import the simulated node; the start gate's path stays free of the heavy libraries."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from tests import pvelike

PKG = os.path.join(pvelike.REPO, "pvegpu")
EDGE = {"cli", "__main__", "wiring"}  # the command line (pvegpu/cli/), the composition root and the entry point
HEAVY = ("typer", "rich", "proxmoxer", "structlog", "pydantic", "requests", "urllib3")  # the gate reads NVML through nvidia-ml-py


def _modules() -> dict[str, set[str]]:
    """dotted module name -> absolute names of the pvegpu modules it imports (anywhere in the file)."""
    out: dict[str, set[str]] = {}
    for dirpath, _dirs, files in os.walk(PKG):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), pvelike.REPO)[:-3].replace(os.sep, ".")
            name = rel.removesuffix(".__init__")
            package = name if f == "__init__.py" else name.rpartition(".")[0]
            tree = ast.parse(open(os.path.join(dirpath, f), encoding="utf-8").read())
            deps: set[str] = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    base = package.split(".")
                    if node.level:
                        base = base[: len(base) - node.level + 1]
                        target = ".".join(base + ([node.module] if node.module else []))
                    else:
                        target = node.module or ""
                    deps.add(target)
                    deps.update(f"{target}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names)
            out[name] = {d for d in deps if d.startswith("pvegpu")}
    return out


def _layer(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in ("adapters", "sim", "testing"):  # testing: the public fakes, above sim
        return parts[1]
    if len(parts) > 1 and parts[1] in EDGE:
        return "edge"
    return "core"


def _hits(deps: set[str], layers: set[str]) -> list[str]:
    mods = _modules()
    return sorted(d for d in deps if d in mods and _layer(d) in layers)


def test_core_imports_no_adapter_sim_or_edge():
    """No core module (locate, holders, reset, gate, audit, ...) imports adapters/, sim/, cli, hook or wiring."""
    bad = {m: _hits(d, {"adapters", "sim", "edge"}) for m, d in _modules().items() if _layer(m) == "core"}
    assert not {m: h for m, h in bad.items() if h}


def test_adapters_import_no_sim_and_no_edge():
    """adapters/ never imports sim/ or the edges (the arrow that ran back up a layer is gone)."""
    bad = {m: _hits(d, {"sim", "edge"}) for m, d in _modules().items() if _layer(m) == "adapters"}
    assert not {m: h for m, h in bad.items() if h}


def test_sim_imports_no_edge():
    """sim/ builds on the core and the adapters, never on cli, hook or wiring."""
    bad = {m: _hits(d, {"edge"}) for m, d in _modules().items() if _layer(m) == "sim"}
    assert not {m: h for m, h in bad.items() if h}


def test_nothing_of_the_product_imports_the_fakes():
    """pvegpu.testing (the public fakes) is for tests only: no core, adapter, sim or edge module imports it."""
    bad = {m: _hits(d, {"testing"}) for m, d in _modules().items() if _layer(m) != "testing"}
    assert not {m: h for m, h in bad.items() if h}


def test_only_wiring_reads_settings_among_edges():
    """cli and hook get their settings and ports from wiring; neither calls settings.load nor builds an adapter."""
    mods = _modules()
    for name in ("pvegpu.cli.app", "pvegpu.cli.hook"):
        assert "pvegpu.core.settings.load" not in mods[name], name
        assert not [d for d in mods[name] if d.startswith("pvegpu.adapters.") and d.count(".") > 2 and not d.endswith(
            ("child.call_in_child", "child.Child", "override.allow_once", "override.take", "override.pending"))], name


@pytest.mark.parametrize("phase", ["pre-start", "post-stop"])
def test_hook_path_imports_only_what_the_guard_names(tmp_path, phase):
    """`pvegpu hook VMID PHASE` as the guard runs it (no site, only the directories of ``install.GATE_PACKAGES``) on a
    PVE-like node imports nothing beyond the standard library and those packages: no typer app, no API client; pre-start
    (every guest start) none of the reset, VM reset, gpu-reset modules either, nor the simulated node's."""
    from pvegpu.cli.install import GATE_PACKAGES, fast_path

    root = pvelike.etc_pve(str(tmp_path / "pve"), "n1", {129: "arch: amd64\ndev0: /dev/nvidia0,gid=44\n"})
    code = ("import sys, json; from pvegpu.cli import run; rc = run(sys.argv[1:]); "
            "print(json.dumps([rc, sorted(sys.modules)]), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path[:0] = {fast_path()!r}.split(':'); " + code,
                        "hook", "129", phase], capture_output=True, text=True, timeout=60,
                       env={"PATH": pvelike.PVE_PATH, "LC_ALL": "C", "PVEGPU_PVE_ROOT": root, "PVEGPU_RESET_LOCK_DIR": str(tmp_path / "lock")})
    rc, loaded = json.loads(r.stderr.strip().splitlines()[-1])
    assert rc in (0, 10), r.stderr
    outside = {m.split(".")[0] for m in loaded} - set(sys.stdlib_module_names) - {"__main__"}
    assert outside <= set(GATE_PACKAGES) and not outside & set(HEAVY), outside
    assert "pvegpu.cli.app" not in loaded
    if phase == "pre-start":
        acting = [m for m in loaded if m.split(".")[:2] in (["pvegpu", "reset"], ["pvegpu", "vm"], ["pvegpu", "gpureset"])]
        assert not acting and not {"pvegpu.sim.scenario", "pvegpu.sim.nvml"} & set(loaded), acting


# os.path helpers that only compute on strings (no file system access) may be used by the core
PURE_OS_PATH = {"join", "basename", "dirname", "split", "splitext", "normpath", "relpath", "commonpath", "isabs", "sep"}
IMPURE_TEMPORARY: dict[str, str] = {}  # module -> why it may still touch the outside (none left)


def _impure_calls(path: str) -> list[str]:
    """What a module does to the outside: ``open(...)``, ``os.*`` (but pure ``os.path`` helpers), ``subprocess``, ``time.*``."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    bad: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
            bad.append(f"{node.lineno}: open()")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("os", "time", "subprocess"):
            bad.append(f"{node.lineno}: {node.value.id}.{node.attr}")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
              and node.value.value.id == "os" and node.value.attr == "path" and node.attr not in PURE_OS_PATH):
            bad.append(f"{node.lineno}: os.path.{node.attr}")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            bad += [f"{node.lineno}: import {n}" for n in names if n.split(".")[0] in ("subprocess", "time", "socket", "shutil")]
            if isinstance(node, ast.ImportFrom) and node.module in ("os", "os.path", "time"):
                bad += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                        if node.module != "os.path" or a.name not in PURE_OS_PATH]
    # `os.path.join` is seen as the attribute `os.path` too: that one alone is allowed
    return [b for b in bad if not b.endswith(": os.path")]


def _core_files() -> dict[str, str]:
    """dotted name -> file of every core module: ``pvegpu/*.py`` but the edges, and every core package below it
    (any folder but adapters/ and sim/, e.g. ``pvegpu/reset/``)."""
    out: dict[str, str] = {}
    for dirpath, _dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), pvelike.REPO)[:-3].replace(os.sep, ".")
                name = rel.removesuffix(".__init__")
                if _layer(name) == "core":
                    out[name] = os.path.join(dirpath, f)
    return out


def test_core_is_pure():
    """No core module (nor any module of a core package) opens files, calls ``os.*`` (pure ``os.path`` helpers
    aside), ``subprocess`` or ``time.*``: the outside is reached through the ports' adapters only."""
    found = {m: hits for m, p in _core_files().items() if m not in IMPURE_TEMPORARY and (hits := _impure_calls(p))}
    assert not found


def test_purity_check_sees_what_it_forbids(tmp_path):
    """The purity check itself catches each forbidden kind (so an empty finding means something)."""
    src = tmp_path / "m.py"
    src.write_text("import os, time, subprocess\nopen('x')\nos.getpid()\ntime.monotonic()\nsubprocess.run([])\n"
                   "os.path.exists('x')\nos.path.join('a', 'b')\n")
    hits = {h.split(": ", 1)[1] for h in _impure_calls(str(src))}
    assert hits == {"import time", "import subprocess", "open()", "os.getpid", "time.monotonic", "subprocess.run", "os.path.exists"}
    assert set(IMPURE_TEMPORARY) <= set(_core_files())


def test_every_via_word_is_in_the_closed_vocabulary():
    """No module spells a holder's ``via`` word as a bare string where ``model.Via`` names it (the JSON's words)."""
    from pvegpu.core.model import Via

    spelled = []
    for dirpath, _dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py") and f != "model.py":
                tree = ast.parse(open(os.path.join(dirpath, f), encoding="utf-8").read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and node.left.value in Via.ALL \
                            and any(isinstance(c, ast.Attribute) and c.attr == "via" for c in node.comparators):
                        spelled.append(f"{f}:{node.lineno}")
    assert not spelled and Via.ALL == {"nvml", "fd", "maps", "unreadable", "stuck", "budget"}
