"""Application containers (PVE 9.1 OCI images): their reset is their verified restart.

In such a container the workload (a vLLM or SGLang server) is PID 1: pve-container writes the image's
Entrypoint+Cmd as the ``entrypoint`` key (``lxc.init.cmd``), and pvegpu never signals a container's init. Signal
rounds could only end in "init holds the GPU"; stopping PID 1 is stopping the container. So the reset goes straight
to the restart (``restart.restart``): stop through the API, verify while stopped, start (through the start gate,
when the guard is the container's hookscript), verify again.

Manual equivalent: ``pct stop 129; nvidia-smi; pct start 129``.
"""

from __future__ import annotations

from shlex import join

from pvegpu.core.holders import GpuFacts
from pvegpu.core.lxcconf import CtConfig
from pvegpu.core.safetext import escape


def app_reason(config: CtConfig, facts: dict[int, GpuFacts]) -> str | None:
    """Why this container's reset is its restart (None: a container with a system init, reset by signal rounds):
    its config names a PID 1 that is not a system init, or PID 1 of its namespace holds one of its GPUs."""
    if config.app and config.entrypoint is not None:
        return f"an application container: its PID 1 is the workload ({escape(join(config.entrypoint), 120)})"
    init = sorted({h.pid for f in facts.values() for h in f.ct_holders if h.info.is_ct_init})
    if init:
        return f"PID 1 of the container (host pid {', '.join(map(str, init))}) holds its GPU"
    return None


def holds(facts: dict[int, GpuFacts]) -> bool:
    """Does anything in the container hold one of its GPUs (so that only its restart frees it)?"""
    return any(f.ct_holders for f in facts.values())


PLAN = "none: stopped with the container (its reset is its verified restart)"
NO_RESTART = ("--no-restart: only the restart frees an application container's GPU (its PID 1 is never signalled); "
              "its other holders get the signal rounds")
