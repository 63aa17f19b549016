"""The one leftover rule: how much GPU memory is left that no live process outside the target accounts for.

Reset's verify, the start gate, audit and the diagnosis all ask ``leftover(facts, rule)``; nothing else
compares memory with a threshold. NVML's ``used`` includes ~5.9 MiB per live CUDA context that no
per-process figure accounts for (measured on an H200: 8.8 MiB with 1 context, 187.9 with 32), so:

    residual  = used - memory NVML lists for live processes outside the target (and their credited heirs)
    allowance = per_context_bytes x live contexts outside the target
    net       = max(0, residual - allowance)          leftover when net > threshold_bytes

The allowance is only for contexts *outside* the target: the target's own contexts are its leftover, and a
bigger flat threshold would hide a real leak on an idle GPU. A *running* target's own memory is never leftover
(``target_running``: its live processes count like any running guest's). Settings: ``leftover.threshold_mib`` (64)
and ``leftover.per_context_mib`` (6).

What to do about leftover is said here too (``gpu_reset_advice``): a whole-GPU reset (``nvidia-smi -r``) ends the
work of every process on that GPU, so it is advised only for a GPU no live process uses; else its users are named.
"""

from __future__ import annotations

from dataclasses import dataclass

from pvegpu.core.holders import GpuFacts
from pvegpu.core.model import MIB, Holder, Place, Placement, Via

DEFAULT_THRESHOLD_MIB = 64
DEFAULT_PER_CONTEXT_MIB = 6.0  # measured gap per CUDA context: 5.8-5.9 MiB (reference/nvidia-gpu.md)


@dataclass(frozen=True)
class LeftoverRule:
    threshold_bytes: int = DEFAULT_THRESHOLD_MIB * MIB
    per_context_bytes: int = int(DEFAULT_PER_CONTEXT_MIB * MIB)


@dataclass(frozen=True)
class Leftover:
    """One GPU's leftover under the rule; every byte figure is None when it cannot be known (never zero)."""

    residual_bytes: int | None  # used minus the live outside processes' (and heirs') listed memory
    allowance_bytes: int  # per-context overhead of the live contexts outside the target
    contexts_outside: int
    net_bytes: int | None  # residual net of the allowance
    threshold_bytes: int

    @property
    def known(self) -> bool:
        return self.net_bytes is not None

    @property
    def over(self) -> bool:
        """Memory above the threshold that nothing outside the target accounts for (unknown is not over: ask ``known``)."""
        return self.net_bytes is not None and self.net_bytes > self.threshold_bytes


def leftover(facts: GpuFacts, rule: LeftoverRule, *, baseline_bytes: int = 0, target_running: bool = False) -> Leftover:
    """The rule applied to one GPU. ``baseline_bytes``: leftover that was already there before and was not the
    target's (reset's first reading), so only what the target left counts against it. ``target_running``: the
    target is a running guest (``pvegpu check`` of a running container): its live processes' memory (and what its
    heirs were credited) and their contexts are accounted for, as any running guest's are; never leftover."""
    residual = facts.residual_bytes
    n = facts.contexts_outside
    if target_running:
        own = facts.ct_listed_bytes
        residual = None if residual is None or own is None else max(0, residual - own)
        n += _own_contexts(facts, proven_only=False)
    allowance = n * rule.per_context_bytes
    net = None if residual is None else max(0, residual - allowance - max(0, baseline_bytes))
    return Leftover(residual, allowance, n, net, rule.threshold_bytes)


def baseline(facts: GpuFacts, rule: LeftoverRule) -> int:
    """At a reset's first reading: the leftover that was not the target's (an existing leak, a neighbour's hidden
    context, a ghost never seen in the target), i.e. the net leftover less the target's own listed memory and
    the per-context overhead of its own contexts. The target is later judged only on what exceeds it."""
    lo = leftover(facts, rule)
    if lo.net_bytes is None or facts.ct_listed_bytes is None or facts.unproven_bytes is None:
        return 0  # unknown: every byte left counts against the target (never a reason to call it clean)
    own_contexts = _own_contexts(facts, proven_only=True) + len(facts.target_ghosts)
    # a ghost credited to a target heir by a guess (``holders._credit_ghosts``: no link, other ghosts competing) is not
    # provably the target's: it stays in the baseline, so it alone never makes the reset stop the target
    own = facts.ct_listed_bytes - facts.unproven_bytes
    return max(0, lo.net_bytes - own - own_contexts * rule.per_context_bytes)


def _own_contexts(facts: GpuFacts, *, proven_only: bool) -> int:
    """The target's live contexts: its listed processes and the ghosts credited to its heirs (``proven_only``: not
    the ``unproven`` ones)."""
    ct = {h.pid for h in facts.ct_holders}
    return sum(1 for h in facts.ct_holders if Via.NVML in h.via) + sum(
        1 for g, heir in facts.heirs.items() if heir in ct and not (proven_only and g in facts.unproven))


def place_name(p: Placement) -> str:
    """Where a process runs, as the admin names it: ``CT 130``, ``VM 200``, ``the host``..."""
    return {Place.CONTAINER: f"CT {p.vmid}", Place.MONITOR: f"the lxc monitor of CT {p.vmid}", Place.VM: f"VM {p.vmid}",
            Place.HOST: "the host"}.get(p.place, "an unknown place")


def gpu_users(facts: GpuFacts) -> list[Holder]:
    """The live processes that use this GPU: each that NVML lists or that maps the device (it may own a context, or
    keep one); an NVML client with an fd only (persistenced, DCGM) holds no memory and is not a user."""
    return sorted((h for h in facts.ct_holders + facts.other_holders if h.could_own_context), key=lambda h: h.pid)


def users_text(users: list[Holder], most: int = 6) -> str:
    """``CT 130 (pid 5001 python3), the host (pid 77 train)``: the users by place, at most ``most`` pids named."""
    by: dict[str, list[str]] = {}
    for h in users[:most]:
        by.setdefault(place_name(h.info.placement), []).append(f"pid {h.pid} {h.info.comm}")
    more = f" and {len(users) - most} more" if len(users) > most else ""
    return ", ".join(f"{where} ({', '.join(pids)})" for where, pids in by.items()) + more


def gpu_reset_advice(facts: GpuFacts) -> str:
    """What to do about memory on this GPU that no live process accounts for. A whole-GPU reset only while no live
    process uses the GPU (it would end every one's work, a neighbour's too): ``pvegpu gpu-reset N``, which does what
    a bare ``nvidia-smi -r`` needs done first and checks the result (docs/gpu-reset.md); else who uses it, named, and
    how to find what keeps the memory."""
    users = gpu_users(facts)
    g, minor = facts.gpu.index, facts.gpu.minor
    if users:
        return (f"no GPU reset while GPU {g} is in use by {users_text(users)}: it would end their work; find what keeps "
                f"the memory: `fuser -v /dev/nvidia{minor}`")
    return f"no process uses GPU {g} now: `pvegpu gpu-reset {g}`, or reboot the host"
