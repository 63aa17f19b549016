"""The one leftover rule: how much GPU memory is left that no live process outside the target accounts for.

Reset's verify, the start gate, audit and the diagnosis all ask ``leftover(facts, rule)``; nothing else
compares memory with a threshold. NVML's ``used`` includes ~5.9 MiB per live CUDA context that no
per-process figure accounts for (measured on an H200: 8.8 MiB with 1 context, 187.9 with 32), so:

    residual  = used - memory NVML lists for live processes outside the target (and their credited heirs)
    allowance = per_context_bytes x live contexts outside the target
    net       = max(0, residual - allowance)          leftover when net > threshold_bytes

The allowance is only for contexts *outside* the target: the target's own contexts are its leftover, and a
bigger flat threshold would hide a real leak on an idle GPU. Settings: ``leftover.threshold_mib`` (64) and
``leftover.per_context_mib`` (6).
"""

from __future__ import annotations

from dataclasses import dataclass

from .holders import GpuFacts
from .model import MIB, Via

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


def leftover(facts: GpuFacts, rule: LeftoverRule, *, baseline_bytes: int = 0) -> Leftover:
    """The rule applied to one GPU. ``baseline_bytes``: leftover that was already there before and was not the
    target's (reset's first reading), so only what the target left counts against it."""
    residual = facts.residual_bytes
    n = facts.contexts_outside
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
    own_contexts = sum(1 for h in facts.ct_holders if Via.NVML in h.via) + len(facts.target_ghosts) + sum(
        1 for g, heir in facts.heirs.items() if g not in facts.unproven and any(h.pid == heir for h in facts.ct_holders))
    # a ghost credited to a target heir by a guess (``holders._credit_ghosts``: no link, other ghosts competing) is not
    # provably the target's: it stays in the baseline, so it alone never makes the reset stop the target
    own = facts.ct_listed_bytes - facts.unproven_bytes
    return max(0, lo.net_bytes - own - own_contexts * rule.per_context_bytes)
