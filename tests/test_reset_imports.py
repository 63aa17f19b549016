"""What `pvegpu reset` imports: structlog only when it writes events (``-v``), and how adapters' warnings are shown."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = {"minor": 0, "index": 0, "name": "Simulated H200", "total_mib": 143771}
CT = {"vmid": 129, "name": "llm129", "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 2048}]}
WATCHED = ("structlog",)


def _imported(*argv: str) -> tuple[int, set[str]]:
    """Run pvegpu with ``argv`` in a fresh interpreter: its exit code and which of WATCHED it imported."""
    code = ("import sys; from pvegpu.cli import run; rc = run(sys.argv[1:]); "
            f"print(rc, *[m for m in {WATCHED!r} if m in sys.modules], file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO, timeout=120)
    words = p.stderr.strip().splitlines()[-1].split()
    return int(words[0]), set(words[1:])


def test_a_clean_reset_imports_no_structlog(sim_node):
    """A clean reset (one holder, SIGTERM, settle) without ``-v`` writes no events: structlog is not imported."""
    node = sim_node({"node": "pve-sim", "gpus": [GPU], "containers": [CT]})
    rc, mods = _imported("--simulate", node.root, "reset", "129", "--json")
    assert rc == 0 and mods == set()


def test_a_dry_run_imports_no_structlog(sim_node):
    """`reset --dry-run --json` writes no events: no structlog."""
    node = sim_node({"node": "pve-sim", "gpus": [GPU], "containers": [CT]})
    rc, mods = _imported("--simulate", node.root, "reset", "129", "--dry-run", "--json")
    assert rc == 0 and mods == set()


def test_verbose_still_logs_through_structlog(sim_node):
    """`reset --dry-run -v` still configures the event log (structlog)."""
    node = sim_node({"node": "pve-sim", "gpus": [GPU], "containers": [CT]})
    rc, mods = _imported("--simulate", node.root, "reset", "129", "--dry-run", "-v")
    assert rc == 0 and "structlog" in mods


def test_an_adapter_warning_after_configure_is_a_warning_line_on_stderr():
    """An adapter's warning after ``configure`` is one "warning: ..." line on stderr, its text escaped."""
    code = ("import sys; from pvegpu.adapters.logs import configure; configure(verbose=False, json_lines=False); "
            "from pvegpu.adapters.pvesh import _warn; _warn('get /nodes', 'boom\\x1b')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.stderr.splitlines() == ["warning: pvesh get /nodes wrote to stderr (its answer is used): boom\\x1b"]


def test_configure_twice_puts_one_warning_handler_in_place():
    """A second ``configure`` adds no second handler: each warning is still one line."""
    code = ("import logging, sys; from pvegpu.adapters.logs import configure; configure(verbose=False, json_lines=False); "
            "configure(verbose=False, json_lines=False); "
            "print(len(logging.getLogger('pvegpu').handlers)); from pvegpu.adapters.pvesh import _warn; _warn('get /x', 'y')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.stdout.split() == ["1"]
    assert p.stderr.splitlines() == ["warning: pvesh get /x wrote to stderr (its answer is used): y"]
