"""``python -m pvegpu`` with the simulated node's GPUs and processes, but the Proxmox API the settings name.

The composition root uses the simulated node for everything or nothing (``--simulate``); the fault matrix
needs the real HTTPS / pvesh adapters in front of simulated GPUs. This swaps only the composition root's
NVML reader (``NvmlProbe``), ``proc_host`` (for the sim's, from ``FAULTCLI_SIM_ROOT``) and, with ``FAULTCLI_DEVLOG``, the
system log's socket, then runs the real command line unchanged:
``FAULTCLI_SIM_ROOT=DIR python -m tests.fault_cli --config FILE reset 129``.
"""

from __future__ import annotations

import os
import runpy
import sys

from pvegpu import wiring
from pvegpu.sim.host import SessionHost
from pvegpu.sim.nvml import SimNvml
from pvegpu.sim.state import SimState

if __name__ == "__main__":
    root = os.environ["FAULTCLI_SIM_ROOT"]
    wiring.NvmlProbe = lambda details=False: SimNvml(SimState(root))  # type: ignore[assignment, misc]
    wiring.proc_host = lambda: SessionHost(SimState(root))  # type: ignore[assignment]
    if os.environ.get("FAULTCLI_DEVLOG"):  # the system log's socket, for tests that read what pvegpu logged
        from pvegpu.adapters import journal

        journal.DEV_LOG = os.environ["FAULTCLI_DEVLOG"]
    sys.argv[0] = "pvegpu"
    runpy.run_module("pvegpu", run_name="__main__", alter_sys=True)
