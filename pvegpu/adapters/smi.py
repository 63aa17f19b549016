"""``nvidia-smi`` for ``pvegpu gpu-reset``: persistence mode and the reset itself, each run under a deadline.

The binary is a setting (``gpureset.smi``): a simulated node and the tests point it at a stand-in. pvegpu never runs
it otherwise than from ``pvegpu gpu-reset`` after the plan was shown and confirmed.
"""

from __future__ import annotations

import os
import subprocess

from pvegpu.core.errors import GpuQueryError
from pvegpu.core.model import GpuInfo
from pvegpu.core.safetext import escape

FABRIC_COMMS = ("nv-fabricmanage",)  # /proc/<pid>/comm is cut at 15 characters: nv-fabricmanager


class SmiControl:
    """The ``GpuControl`` port over ``nvidia-smi`` at ``path``; each call bounded by ``timeout`` seconds."""

    def __init__(self, path: str, timeout: float, env: dict[str, str] | None = None) -> None:
        self.path, self.timeout, self.env = path, timeout, env

    def _run(self, args: list[str], what: str) -> None:
        argv = [self.path, *args]
        try:
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                               timeout=self.timeout, env=self.env)
        except subprocess.TimeoutExpired:
            raise GpuQueryError(f"`{' '.join(argv)}` did not finish within {self.timeout:g} s", f"{what}: check `dmesg` for Xid lines; "
                                "the GPU may need a reboot") from None
        except OSError as exc:
            raise GpuQueryError(f"cannot run {self.path}: {exc.strerror or exc}", "set gpureset.smi to nvidia-smi's path") from None
        if p.returncode != 0:
            said = " | ".join(line.strip() for line in (p.stdout + p.stderr).splitlines() if line.strip())[:400]
            raise GpuQueryError(f"`{' '.join(argv)}` failed (exit {p.returncode}): {escape(said) or 'no output'}", what)

    def persistence(self, gpu: GpuInfo, on: bool) -> None:
        self._run(["-i", gpu.uuid, "-pm", "1" if on else "0"], "persistence mode")

    def reset(self, gpu: GpuInfo) -> None:
        self._run(["-r", "-i", gpu.uuid], "the GPU reset")

    def fabric_manager(self) -> bool | None:
        """A process named nv-fabricmanager on the node (``pgrep nv-fabricmanage``); None when /proc cannot be read."""
        try:
            pids = [p for p in os.listdir("/proc") if p.isdigit()]
        except OSError:
            return None
        for pid in pids:
            try:
                with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
                    if f.read().strip() in FABRIC_COMMS:
                        return True
            except OSError:
                continue
        return False
