"""The simulated node's files for the audit: stand-in devices play ``/dev/nvidia*``, snippets live in its own
directory, a container runs when its state says so (no lxc command socket here)."""

from __future__ import annotations

import os

from pvegpu.adapters.nodefiles import LocalNodeFiles
from pvegpu.sim.state import SimState

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


class SimNodeFiles(LocalNodeFiles):
    """A GPU with ``driver_ready: false`` has no device node yet (boot before the driver); nor has the control node then."""

    def __init__(self, root: str) -> None:
        self.state = SimState(root)
        gpus = self.state.gpus()
        ready = [g for g in gpus if g.get("driver_ready", True)]
        dev_map = {f"/dev/nvidia{g['minor']}": (str(g["stand_in"]) if g in ready else "/nonexistent") for g in gpus}
        dev_map |= {p: (str(ready[0]["stand_in"]) if ready else "/nonexistent") for p in CONTROL_NODES}
        super().__init__(self.state.etc_pve, dev_map=dev_map, snippets_dir=self.state.snippets,
                         sysfs=os.path.join(root, "sys"),  # the scenario's "pci" devices, never this machine's
                         proc=os.path.join(root, "proc"))  # its /proc/driver/nvidia/version; processes are read in /proc by SessionHost

    def ct_root(self, vmid: int, init_pid: int) -> str:
        """A simulated container shares this machine's root: its own root is the node's ``ct-root/<vmid>``."""
        return os.path.join(self.state.root, "ct-root", str(vmid))

    def running_cts(self) -> frozenset[int] | None:
        return frozenset(int(c["vmid"]) for c in self.state.cts() if c.get("status") == "running")
