"""The verdict on one GPU's health: NVML's facts and the kernel log's Xids in, what it needs out (pure).

The rule (``docs/health.md``), in order:

1. NVML says the GPU is lost (``NVML_ERROR_GPU_IS_LOST``): ``lost``; only a reboot brings it back.
2. NVML's recovery action, where the driver reports it, is not ``none``: the GPU needs that action.
3. A fatal Xid (the catalogue says reset or reboot) logged since the GPU's last reset counts (where containers'
   firewalls may write kernel records too, ``net.netfilter.nf_log_all_netns = 1``, only while NVML does not report a
   recovery action, which then has the last word): the GPU needs what the
   catalogue says. The last reset is the newest reset record of that GPU in the log (``health.kernlog``); a boot
   starts a new log, so an Xid of an earlier boot never counts. A refusal is a state, not a latch: once NVML says
   ``none`` (or does not report the action) and a reset is newer than every fatal Xid, the GPU is healthy again.
4. The worst of 2 and 3 is the verdict (``needs-reboot`` over ``needs-gpu-reset``).
5. Nothing needed: ``ok`` only when NVML's health reading came back (a GPU whose reading failed may be the lost one),
   the kernel log was read, and, where it no longer holds this boot's first record
   (the ring buffer wrapped), only when NVML also reported the action as ``none``. Otherwise ``unknown``: unknown is
   never healthy, and it is never a refusal on its own either.

Application Xids (13, 31, 43, ...) since the last reset are listed and need nothing of the GPU; pending row remapping
or page retirement, a failed remapping and volatile uncorrected ECC errors are notes (the audit flags them).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pvegpu.core.model import GpuHealth
from pvegpu.core.safetext import shown
from pvegpu.health.catalogue import Need, describe, recovery_need
from pvegpu.health.kernlog import KernelEvents, XidEvent


class State(StrEnum):
    OK = "ok"
    NEEDS_RESET = "needs-gpu-reset"
    NEEDS_REBOOT = "needs-reboot"
    LOST = "lost"
    UNKNOWN = "unknown"

    @property
    def said(self) -> str:
        """The state in words ("needs a GPU reset")."""
        return {"needs-gpu-reset": "needs a GPU reset", "needs-reboot": "needs a reboot", "lost": "is lost"}.get(self.value, f"is {self.value}")


REFUSING = (State.NEEDS_RESET, State.NEEDS_REBOOT, State.LOST)


@dataclass(frozen=True)
class Verdict:
    """One GPU's health: its state, why (``reason``), what to do (``action``, "" when nothing), the fatal Xids that
    count (since its last reset), the application Xids since then, and notes."""

    state: State
    reason: str
    action: str = ""
    xids: tuple[XidEvent, ...] = ()
    app_xids: tuple[XidEvent, ...] = ()
    notes: tuple[str, ...] = ()
    recovery_action: str | None = None

    @property
    def refuses(self) -> bool:
        """The GPU must not take new work: it needs a reset or a reboot, or it is lost."""
        return self.state in REFUSING

    def to_json(self) -> dict[str, object]:
        return {"state": self.state.value, "reason": self.reason, "action": self.action or None,
                "recovery_action": self.recovery_action, "xids": [x.to_json() for x in self.xids],
                "application_xids": [x.to_json() for x in self.app_xids], "notes": list(self.notes)}


def xid_text(x: XidEvent) -> str:
    when = "" if x.at_us is None else f" at {x.at_us / 1e6:.0f} s after boot"
    what = describe(x.code)
    return f"Xid {x.code}{f' ({what})' if what else ''}{when}"


def _action(need: Need, index: str) -> str:
    if need is Need.REBOOT:
        return "reboot the node (stop or migrate its guests first); no GPU reset can bring it back"
    return f"`pvegpu gpu-reset {index}` (it stops the CTs on it and starts them again), or reboot the node"


def judge(health: GpuHealth | None, log: KernelEvents | None, bus_id: str, uuid: str = "", index: str = "N") -> Verdict:
    """The verdict for the GPU at ``bus_id`` (``uuid``: resets logged by UUID; ``index`` names it in the advice) from its
    NVML health (None: NVML's health reading failed or never came) and the kernel log's events (``log`` None: not read)."""
    unread = health is None  # NVML could not be asked: the log's fatal Xids still count, but nothing says "ok"
    health = health if health is not None else GpuHealth()
    action = health.recovery_action
    notes = _notes(health)
    if health.lost:
        return Verdict(State.LOST, "NVML says the GPU is lost (fallen off the bus)", _action(Need.REBOOT, index),
                       notes=notes, recovery_action=action)
    fatal: list[XidEvent] = []
    apps: list[XidEvent] = []
    last_reset = -1
    if log is not None and log.read:
        xids, resets = log.of(bus_id, uuid)
        last_reset = max((r.seq for r in resets), default=-1)
        since = [x for x in xids if x.seq > last_reset]
        fatal = [x for x in since if x.need >= Need.RESET]
        apps = [x for x in since if x.need is Need.APPLICATION]
        notes += tuple(f"Xid {x.code} logged, not in pvegpu's catalogue: {shown(x.text[:120])}" for x in since if x.need is Need.UNLISTED)
        if fatal and log.forgeable and action is not None:  # NVML, which no tenant writes, has the last word then
            notes += (f"{len(fatal)} fatal Xid record(s) logged, not counted: containers' firewalls may write kernel "
                      f"records here (net.netfilter.nf_log_all_netns = 1) and NVML's recovery action is {action}",)
            fatal = []
    xid_need = max((x.need for x in fatal), default=Need.NOTHING)
    nvml_need = recovery_need(action) if action is not None else Need.NOTHING
    need = max(xid_need, nvml_need)
    if need >= Need.RESET:
        why = []
        if nvml_need >= Need.RESET:
            why.append(f"NVML's recovery action is {action}")
        if fatal:
            later = "after its last logged GPU reset" if last_reset >= 0 else "and no GPU reset logged since"
            why.append("the kernel log has " + ", ".join(xid_text(x) for x in fatal[-3:]) + f", {later}")
        return Verdict(State.NEEDS_REBOOT if need is Need.REBOOT else State.NEEDS_RESET, "; ".join(why), _action(need, index),
                       tuple(fatal), tuple(apps), notes, action)
    if unread:
        return Verdict(State.UNKNOWN, "NVML's health reading of this GPU failed (or did not come in time): whether it is "
                       "lost or needs a recovery action is unknown", "", (), tuple(apps), notes, action)
    if log is None or not log.read:
        return Verdict(State.UNKNOWN, f"the kernel log cannot be read ({log.error if log is not None else 'not read'}): "
                       f"Xids since boot unknown; NVML's recovery action: {action or 'not reported'}", "", (), (), notes, action)
    if not log.complete and action is None:
        return Verdict(State.UNKNOWN, "the kernel log no longer holds this boot's first records and NVML does not report a "
                       "recovery action: an early Xid may be gone", "", (), tuple(apps), notes, action)
    reason = "no fatal Xid since boot or since the last GPU reset" + ("" if action is not None else "; NVML does not report a recovery action")
    return Verdict(State.OK, reason, "", (), tuple(apps), notes, action)


def _notes(h: GpuHealth) -> tuple[str, ...]:
    out = []
    if h.remap_pending or h.retired_pages_pending:
        out.append("row remapping / page retirement waits for a GPU reset")
    if h.remap_failed:
        out.append("a row remapping failed: the GPU should be serviced")
    if h.ecc_volatile_uncorrected:
        out.append(f"{h.ecc_volatile_uncorrected} uncorrected ECC error(s) since the driver loaded")
    return tuple(out)
