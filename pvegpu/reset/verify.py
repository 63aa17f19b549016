"""Verify with host NVML that a container's GPU memory is back, and stays back for ``settle`` seconds.

Manual equivalent: ``watch -n 0.05 nvidia-smi --query-compute-apps=pid,used_memory`` until nothing of
the container is listed and ``nvidia-smi -q -d MEMORY`` shows the memory free.
"""

from __future__ import annotations

from pvegpu.core.deadline import Deadline
from pvegpu.core.holders import GpuFacts
from pvegpu.core.leftover import LeftoverRule, leftover
from pvegpu.reset.results import Verified
from pvegpu.reset.run import ResetRun
from pvegpu.reset.vocab import StepName, StepOutcome


def own_leftover_gone(facts: GpuFacts, rule: LeftoverRule) -> bool:
    """Nothing of the target's own is left on this GPU: no holder, no ghost of its, and no more memory left
    than was already left before the reset by others (the one leftover rule, net of that baseline)."""
    lo = leftover(facts, rule, baseline_bytes=facts.baseline_bytes)
    return (facts.sample.known and not facts.ct_holders and not facts.target_ghosts and not facts.unreadable
            and lo.known and not lo.over)


def is_clean(facts: GpuFacts, rule: LeftoverRule | int) -> bool:
    """The verified-clean predicate for one GPU after a reset: the target is judged on its own memory.
    Memory that was never the target's (an existing leak, a neighbour's hidden context, a ghost never seen in
    the target) does not make it unclean; the report names it (``diagnosis.foreign_leftover``)."""
    if isinstance(rule, int):
        rule = LeftoverRule(threshold_bytes=rule)
    return own_leftover_gone(facts, rule) and not facts.unplaced


def all_clean(facts: dict[int, GpuFacts], rule: LeftoverRule | int) -> bool:
    return all(is_clean(f, rule) for f in facts.values())


def verify(run: ResetRun, facts: dict[int, GpuFacts], deadline: Deadline) -> tuple[dict[int, GpuFacts], Verified]:
    """Read until clean has held for ``settle``, holders appear, or ``deadline`` passes.

    Clean counts from the end of the first clean reading to the start of the latest one, so a slow read
    never stretches it; the deadline is checked after every read. Memory that comes back inside the last
    settle window is UNSETTLED, never CLEAN. While not clean, readings are paced by ``run.pace()`` (every 5 ms
    for the first 0.5 s while a reading is cheap, then every ``poll``); once clean, every ``poll``, and the
    reading that closes the window starts when the window ends (``clean_since + settle``), not up to a poll later.
    """
    clock, pol = run.clock, run.policy
    pace = run.pace()
    t0 = read_start = read_end = clock.monotonic()
    clean_since: float | None = None
    while True:
        if all_clean(facts, pol.rule):
            if clean_since is None:
                clean_since = read_end
            if max(0.0, read_start - clean_since) >= pol.settle:
                run.step(StepName.VERIFY, StepOutcome.CLEAN, f"NVML agrees: memory back after {clean_since - t0:.3f} s (held for {pol.settle:g} s)",
                         seconds=round(clean_since - t0, 3))
                return facts, Verified.CLEAN
        else:
            clean_since = None
            if run.targets(facts).signalled:
                return facts, Verified.HOLDERS
        if deadline.expired():
            waited = clock.monotonic() - t0
            if clean_since is not None:
                held = max(0.0, read_start - clean_since)
                run.step(StepName.VERIFY, StepOutcome.UNSETTLED, f"clean for only {held:.3f} s of the {pol.settle:g} s settle when the wait "
                         f"ended after {waited:.3f} s: not verified", seconds=round(waited, 3), held=round(held, 3))
                return facts, Verified.UNSETTLED
            run.step(StepName.VERIFY, StepOutcome.TIMEOUT, f"not clean after {waited:.3f} s", seconds=round(waited, 3))
            return facts, Verified.NOT_CLEAN
        if clean_since is None:
            wait = pace.after(run.read_cost)  # waiting for the release: fast while readings are cheap
        else:
            wait = min(pol.poll, clean_since + pol.settle - clock.monotonic())  # the closing reading starts as the window ends
        deadline.pause(max(0.0, wait))
        read_start = clock.monotonic()
        facts = run.inspect()
        read_end = clock.monotonic()
