"""What every phase of one ``pvegpu reset`` shares: ports, policy, report, steps, readings, deadlines."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .inspect import FirstReading, GpuFacts, inspect_gpus
from .leftover import baseline
from .locate import Located
from .model import Guest, Holder, Step
from .ports import Clock
from .reset_report import Ports, ResetPolicy, ResetReport


@dataclass(frozen=True)
class Deadline:
    """A point in ``clock`` time. Loops check it after each read, so a slow read cannot hide it."""

    clock: Clock
    at: float

    def remaining(self) -> float:
        return max(0.0, self.at - self.clock.monotonic())

    def expired(self) -> bool:
        return self.clock.monotonic() >= self.at

    def within(self, seconds: float) -> Deadline:
        """A deadline ``seconds`` from now, never later than this one."""
        return Deadline(self.clock, min(self.at, self.clock.monotonic() + max(0.0, seconds)))

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or until the deadline if that comes first."""
        self.clock.sleep(min(seconds, self.remaining()))


class ResetRun:
    """One run of ``pvegpu reset VMID``: the phases (reset_stop, reset_verify, reset_restart) act on it."""

    def __init__(self, vmid: int, ports: Ports, policy: ResetPolicy, on_step: Callable[[Step], None] | None = None) -> None:
        self.vmid = vmid
        self.p = ports
        self.policy = policy
        self.report = ResetReport(vmid)
        self.on_step = on_step
        self.located: Located | None = None
        self.deadline = Deadline(ports.clock, ports.clock.monotonic() + policy.budget)
        self.first = FirstReading()  # the first reading's listed pids (whose ghost is whose) and leftover baseline

    @property
    def clock(self) -> Clock:
        return self.p.clock

    @property
    def guest(self) -> Guest:
        assert self.located is not None
        return self.located.guest

    def step(self, name: str, outcome: str, msg: str, **detail: object) -> None:
        """Record one thing reset did: in the report, on the event log and live on the terminal."""
        s = Step(name, outcome, {"msg": msg, **detail})
        self.report.steps.append(s)
        self.p.log.info(f"reset.{name}", vmid=self.vmid, outcome=outcome, msg=msg, **detail)
        if self.on_step:
            self.on_step(s)

    def inspect(self, whole_host: bool = False) -> dict[int, GpuFacts]:
        """One reading of the container's GPUs (``nvidia-smi`` + ``fuser -v /dev/nvidia*``)."""
        assert self.located is not None
        first = self.first.done
        facts = inspect_gpus(self.vmid, self.located.gpus, host=self.p.host, probe=self.p.probe, whole_host=whole_host,
                             first=self.first)
        if not first:
            self.first.baseline = {m: baseline(f, self.policy.rule) for m, f in facts.items()}
        for m, f in facts.items():
            f.baseline_bytes = self.first.baseline.get(m, 0)
        return facts

    def killable(self, facts: dict[int, GpuFacts]) -> dict[int, Holder]:
        """Holders pvegpu may signal: payload processes of the container (never its init, never pvegpu)."""
        out: dict[int, Holder] = {}
        for f in facts.values():
            for h in f.ct_holders:
                if not h.info.is_ct_init and h.pid != self.p.host.self_pid and h.info.state not in ("Z", "X"):
                    out.setdefault(h.pid, h)
        return out
