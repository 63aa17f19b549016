"""PVE's own command-line tools (``pct``, ``pvesm``), run with a deadline: what ``hook install`` changes through.

The simulated node's counterpart is ``pvegpu.sim.pvecli.SimPveCli``.
"""

from __future__ import annotations

import subprocess


def run_command(argv: list[str]) -> tuple[int, str]:
    """Run a PVE CLI command (``pct``, ``pvesm``) with a deadline; (exit code, combined output)."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found (is this a Proxmox VE node?)"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(argv)}: no answer within 60 s"
    return p.returncode, (p.stdout + p.stderr).strip()
