"""What `pvegpu reset` imports on its way to the first signal: nothing it does not need (start-up is a reset's cost)."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = {"minor": 0, "index": 0, "name": "Simulated H200", "total_mib": 143771}
CT = {"vmid": 129, "name": "llm129", "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 2048}]}
WATCHED = ("logging", "traceback", "pvegpu.reset.restart", "pvegpu.reset.follow", "typer", "structlog")


def _imported(*argv: str) -> tuple[int, set[str]]:
    """Run pvegpu with ``argv`` in a fresh interpreter: its exit code and which of WATCHED it imported."""
    code = ("import sys; from pvegpu.frontdoor import main; sys.argv = ['pvegpu', *sys.argv[1:]]; rc = main(); "
            f"print(rc, *[m for m in {WATCHED!r} if m in sys.modules], file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO, timeout=120)
    words = p.stderr.strip().splitlines()[-1].split()
    return int(words[0]), set(words[1:])


def test_a_clean_reset_imports_no_logging_and_no_restart_phase(sim_node):
    """A clean reset (one holder, SIGTERM, settle) needs neither the stdlib logging nor the restart phase: not imported."""
    node = sim_node({"node": "pve-sim", "gpus": [GPU], "containers": [CT]})
    rc, mods = _imported("--simulate", node.root, "reset", "129", "--json")
    assert rc == 0 and mods == set()


def test_a_dry_run_imports_no_logging(sim_node):
    """`reset --dry-run --json`: no logging, no restart phase, no typer, no structlog."""
    node = sim_node({"node": "pve-sim", "gpus": [GPU], "containers": [CT]})
    rc, mods = _imported("--simulate", node.root, "reset", "129", "--dry-run", "--json")
    assert rc == 0 and mods == set()


def test_verbose_still_logs_through_structlog(sim_node):
    """`reset --dry-run -v` still configures the event log (structlog, which brings logging)."""
    node = sim_node({"node": "pve-sim", "gpus": [GPU], "containers": [CT]})
    rc, mods = _imported("--simulate", node.root, "reset", "129", "--dry-run", "-v")
    assert rc == 0 and {"structlog", "logging"} <= mods


def test_an_adapter_warning_after_configure_is_a_warning_line_on_stderr():
    """logging is imported at the first adapter warning, and that warning is still one "warning: ..." line on stderr."""
    code = ("import sys; from pvegpu.logs import configure; configure(verbose=False, json_lines=False); "
            "before = 'logging' in sys.modules; from pvegpu.adapters.pvesh import _warn; _warn('get /nodes', 'boom\\x1b'); "
            "print(before, 'logging' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.stdout.split() == ["False", "True"]
    assert p.stderr.splitlines() == ["warning: pvesh get /nodes wrote to stderr (its answer is used): boom\\x1b"]


def test_an_adapter_warning_when_logging_was_imported_first_is_a_warning_line_too():
    """With logging already imported (a library did it), configure puts the same handler in place at once."""
    code = ("import logging, sys; from pvegpu.logs import configure; configure(verbose=False, json_lines=False); "
            "print(len(logging.getLogger('pvegpu').handlers)); from pvegpu.adapters.pvesh import _warn; _warn('get /x', 'y')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.stdout.split() == ["1"]
    assert p.stderr.splitlines() == ["warning: pvesh get /x wrote to stderr (its answer is used): y"]
