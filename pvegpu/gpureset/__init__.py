"""``pvegpu gpu-reset N``: the step between a kill and a reboot, as a verified procedure (docs/gpu-reset.md).

The face of the package: import from here. ``resolve`` (which GPU N names), ``plan`` (step b: every guest granted the
GPU, every process using it, what will be done to each, and the refusals known before anything is stopped),
``procedure`` (steps c-h: stop, persistence off, clients gone, ``nvidia-smi -r``, verify, persistence back, start
again, the verdict), ``model`` (policy, plan rows, report, ports). The draining mark and the lock are the caller's
(``adapters/drain.py``, taken by the command line around ``execute``); the API stop/start, their HA handling and the
interruption wording are the reset's (``pvegpu.reset.restart``, ``pvegpu.reset.interruption``).
"""

from __future__ import annotations

from pvegpu.gpureset.model import ClientPlan, GpuResetPolicy, GpuResetPorts, GpuResetReport, GuestPlan, Outcome, Refusal
from pvegpu.gpureset.plan import make_plan
from pvegpu.gpureset.procedure import execute
from pvegpu.gpureset.resolve import resolve

__all__ = ["ClientPlan", "GpuResetPolicy", "GpuResetPorts", "GpuResetReport", "GuestPlan", "Outcome", "Refusal", "execute",
           "make_plan", "resolve"]
