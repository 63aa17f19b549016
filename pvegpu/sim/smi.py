"""The simulated node's stand-in ``nvidia-smi``: ``-i UUID -pm 0|1`` and ``-r -i UUID``, as unkind as the real one.

``sim create`` writes ``DIR/bin/nvidia-smi``, which runs ``python -m pvegpu.sim.smi DIR ARGS``. The reset fails
"In use by another client" while any process holds the GPU's device node (its stand-in file) or persistence mode
is on; "not supported" when the GPU's ``reset_supported`` is false; ``reset_hang`` (seconds) makes it slow. A
reset that goes through clears the GPU's ``leak_mib``, ``fail`` and ``lost``, sets a known ``recovery_action`` to
"none". Like the real one it writes nothing to the kernel log that ends the GPU's Xids: ``pvegpu gpu-reset`` records
the reset it verified (``health.reset_record``).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from typing import Any

from pvegpu.adapters.smi import SmiControl
from pvegpu.sim.host import SessionHost
from pvegpu.sim.state import SimState, read_json
from pvegpu.sim.trust import SCENARIO

BIN = "bin/nvidia-smi"


def script(root: str) -> bytes:
    """The stand-in binary of the node in ``root``: this Python, this package, that node."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return (f"#!/bin/sh\nPYTHONPATH={shlex.quote(here)} exec {shlex.quote(sys.executable)} -m pvegpu.sim.smi "
            f"{shlex.quote(os.path.abspath(root))} \"$@\"\n").encode()


def _bus(g: dict[str, Any]) -> str:
    return "0000" + str(g.get("bus_id", f"0000:{0x41 + int(g['minor']):02x}:00.0"))


def _find(gpus: list[dict[str, Any]], ident: str) -> dict[str, Any] | None:
    for i, g in enumerate(gpus):
        if ident in (str(g.get("uuid", f"GPU-sim-{g['minor']}")), str(g.get("index", i))):
            return g
    return None


def _held(state: SimState, minor: int) -> list[int]:
    return sorted(pid for pid, h in SessionHost(state).holdings().items() if minor in h.minors and pid != os.getpid())


def main(argv: list[str]) -> int:
    root, args = argv[0], argv[1:]
    state = SimState(root)
    ident = args[args.index("-i") + 1] if "-i" in args and args.index("-i") + 1 < len(args) else ""
    gpus = state.gpus()
    g = _find(gpus, ident)
    if g is None:
        print(f"No devices were found matching the identifier {ident!r}", file=sys.stderr)
        return 6
    if g.get("lost"):
        print(f"Unable to determine the device handle for GPU {_bus(g)}: GPU is lost.  Reboot the system to recover this GPU",
              file=sys.stderr)
        return 15
    if "-pm" in args:
        on = args[args.index("-pm") + 1] == "1"
        state.set_gpus([x | {"persistence_mode": on} if x is g else x for x in gpus])
        print(f"{'Enabled' if on else 'Disabled'} persistence mode for GPU {_bus(g)}.\nAll done.")
        return 0
    if "-r" not in args:
        print("stand-in nvidia-smi: only -pm and -r", file=sys.stderr)
        return 2
    time.sleep(float(g.get("reset_hang", 0) or 0))
    if g.get("reset_supported") is False:
        print(f"Resetting GPU {_bus(g)} is not supported.", file=sys.stderr)
        return 3
    holders = _held(state, int(g["minor"]))
    if g.get("persistence_mode") or holders:
        print(f"The following GPUs could not be reset:\n  GPU {_bus(g)}: In use by another client\n\n1 device is currently being "
              "used by one or more other processes (e.g., Fabric Manager, CUDA application, graphics application such as an X "
              "server, or a monitoring application such as another instance of nvidia-smi).", file=sys.stderr)
        return 255
    fresh = {k: v for k, v in g.items() if k not in ("leak_mib", "fail", "lost")}
    if fresh.get("recovery_action") is not None:
        fresh["recovery_action"] = "none"
    state.set_gpus([fresh if x is g else x for x in gpus])  # the driver logs nothing pvegpu reads: gpu-reset records it
    print(f"GPU {_bus(g)} was successfully reset.\nAll done.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


class SimSmi(SmiControl):
    """The ``GpuControl`` of a simulated node: its stand-in binary, and Fabric Manager from the scenario's
    ``fabric_manager`` (absent: not running)."""

    def __init__(self, root: str, timeout: float) -> None:
        super().__init__(os.path.join(root, BIN), timeout)
        self.root = root

    def fabric_manager(self) -> bool | None:
        meta = read_json(os.path.join(self.root, SCENARIO), {})
        fm = meta.get("fabric_manager", False) if isinstance(meta, dict) else None
        return None if fm is None else bool(fm)
