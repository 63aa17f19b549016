"""What every phase of one ``pvegpu reset`` shares: ports, policy, report, steps, readings, deadlines."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from pvegpu.core.deadline import Deadline
from pvegpu.core.holders import FirstReading, GpuFacts, inspect_gpus
from pvegpu.core.leftover import baseline, leftover
from pvegpu.core.locate import Located
from pvegpu.core.model import Guest, SignalResult, Step
from pvegpu.core.ports import Clock
from pvegpu.core.units import mib
from pvegpu.reset.poll import Pace
from pvegpu.reset.report import Ports, ResetPolicy, ResetReport
from pvegpu.reset.results import CtTrack
from pvegpu.reset.targets import Targets, targets
from pvegpu.reset.vocab import CtState, StepName, StepOutcome

GONE = ("GPU is lost", "GPU not found", "GPU requires reset")  # NVML errors a GPU does not recover from by itself


class ResetRun:
    """One run of ``pvegpu reset VMID``: the phases (stop, verify, restart) act on it."""

    def __init__(self, vmid: int, ports: Ports, policy: ResetPolicy, on_step: Callable[[Step], None] | None = None,
                 on_progress: Callable[[str], None] | None = None) -> None:
        self.vmid = vmid
        self.p = ports
        self.policy = policy
        self.report = ResetReport(vmid)
        self.on_step = on_step
        self.on_progress = on_progress
        self.ha_state: str | None = None  # HA's state of the CT at the last read (HA-managed only)
        self._said: tuple[str, float] = ("", 0.0)
        self.last_facts: dict[int, GpuFacts] = {}  # the latest reading of the container's GPUs (for progress)
        self._gone_said = False
        self.located: Located | None = None
        self.deadline = Deadline(ports.clock, ports.clock.monotonic() + policy.budget)
        self.ct = CtTrack()  # where the restart phase has taken the CT (the report copies it at the end)
        self.first = FirstReading()  # the first reading's listed pids (whose ghost is whose) and leftover baseline
        self.read_cost = 0.0  # seconds the latest reading of the container's GPUs took (``Pace``: fast polls only while cheap)

    @property
    def clock(self) -> Clock:
        return self.p.clock

    @property
    def guest(self) -> Guest:
        assert self.located is not None
        return self.located.guest

    def step(self, name: StepName, outcome: StepOutcome | SignalResult | CtState | str, msg: str, **detail: object) -> None:
        """Record one thing reset did: in the report, on the event log and live on the terminal. ``outcome`` is from
        the closed vocabularies (a plain str only for the ``interrupted`` step: the signal's name); the report,
        the JSON and the log carry their plain values."""
        word = str(getattr(outcome, "value", outcome))  # a vocabulary's member (its value) or a plain word
        s = Step(name.value, word, {"msg": msg, **detail})
        self.report.steps.append(s)
        self.event(f"reset.{name.value}", outcome=word, msg=msg, **detail)
        if self.on_step:
            self.on_step(s)

    def event(self, event: str, **detail: object) -> None:
        """One event on the EventLog. The log is information: whatever it raises (a terminal gone, a closed pipe,
        a broken renderer) must not end a reset, above all not between the stop request and the start."""
        try:
            self.p.log.info(event, vmid=self.vmid, **detail)
        except Exception:  # noqa: BLE001 - see above; the report still has every step
            pass

    def progress(self, what: str, since: float, deadline: Deadline) -> None:
        """A wait still going on: after its first second, and then every 5 s, say what is awaited and how long is
        left ("waiting for HA to bring CT 129 to running: 3 s of 120"). Human output only; not in the report."""
        if self.on_progress is None:
            return
        now = self.clock.monotonic()
        waited = now - since
        last_what, last_at = self._said
        what_key = what.split(" (")[0]  # the same wait, whatever its figures say now
        if waited < 1.0 or (last_what == what_key and now - last_at < 5.0):
            return
        self._said = (what_key, now)
        total = waited + deadline.remaining()
        self.on_progress(f"{what}: {waited:.0f} s of {total:.0f}")

    def watched(self, deadline: Deadline) -> Deadline:
        """``deadline`` for a wait on the container's GPU memory: its pauses report progress (human output)."""
        return replace(deadline, label=self.memory_wait, on_wait=self.progress, since=self.clock.monotonic(), hopeless=self.gpu_gone)

    def gpu_gone(self) -> bool:
        """Did the latest reading show a GPU that is gone (lost, off the bus, needing a reset)? Waiting for its memory
        cannot help: the wait ends at once (said once), and the GPU stays unknown, never clean."""
        for f in self.last_facts.values():
            err = f.sample.error or ""
            if f.sample.used_bytes is None and any(s in err for s in GONE):
                if not self._gone_said:
                    self._gone_said = True
                    self.step(StepName.VERIFY, StepOutcome.UNREADABLE, f"GPU {f.gpu.index} cannot be read ({err}): it will not come back "
                              "while pvegpu waits; not waiting for the rest of the window", minor=f.gpu.minor)
                return True
        return False

    def memory_wait(self) -> str:
        """What the memory wait is waiting for, from the latest reading ("512 MiB left on GPU 0")."""
        parts = []
        for f in self.last_facts.values():
            lo = leftover(f, self.policy.rule, baseline_bytes=f.baseline_bytes)  # the rule verify judges by
            if not f.sample.known or lo.net_bytes is None:
                parts.append(f"GPU {f.gpu.index} unreadable")
            elif f.ct_holders:
                parts.append(f"{len(f.ct_holders)} holder(s) on GPU {f.gpu.index}")
            elif lo.over:
                parts.append(f"{mib(lo.net_bytes, grouped=True)} left on GPU {f.gpu.index}")
        return f"waiting for CT {self.vmid}'s GPU memory (" + (", ".join(parts) or "back; holding for the settle window") + ")"

    def inspect(self, whole_host: bool = False) -> dict[int, GpuFacts]:
        """One reading of the container's GPUs (``nvidia-smi`` + ``fuser -v /dev/nvidia*``)."""
        assert self.located is not None
        first = self.first.done
        t = self.clock.monotonic()
        facts = inspect_gpus(self.vmid, self.located.gpus, host=self.p.host, probe=self.p.probe, whole_host=whole_host,
                             first=self.first)
        if not first:
            self.first.baseline = {m: baseline(f, self.policy.rule) for m, f in facts.items()}
        for m, f in facts.items():
            f.baseline_bytes = self.first.baseline.get(m, 0)
        if not whole_host:
            self.last_facts = facts
            self.read_cost = self.clock.monotonic() - t
        return facts

    def pace(self, fast: float | None = None) -> Pace:
        """The pacing of a wait that starts now, right after signals: fast (``fast``, else ``fast_poll``) while its
        readings are cheap, then ``poll``."""
        return Pace(self.clock, self.policy.poll, self.policy.fast_poll if fast is None else fast, self.policy.fast_for)

    def targets(self, facts: dict[int, GpuFacts]) -> Targets:
        """Who this reading says gets which signal (``targets.targets``: the one rule; never its init, never pvegpu)."""
        return targets(facts, self.p.host.self_pid)
