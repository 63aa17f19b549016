"""The Xid catalogue: what each Xid code the driver logs asks of the admin (one home for it).

Buckets follow NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, "Resolution
Bucket (Immediate Action)") for Ampere and newer GPUs, reduced to what pvegpu does with a GPU:

- ``APPLICATION``: RESTART_APP / IGNORE: the application that hit it failed, the GPU is fine; nothing to do for the GPU
  (the codes NVIDIA's k8s device plugin also ignores: 13, 31, 43, 45, 68, 109);
- ``RESET``: RESET_GPU: the GPU needs a reset (``nvidia-smi -r``) before new work; a reboot also clears it;
- ``REBOOT``: RESTART_BM: only a reboot of the node brings the GPU back (fallen off the bus);
- ``WATCH``: reported, no action on the GPU (a high single-bit ECC rate, a corrected event).

Xid 154 carries the driver's recovery action in its text ("GPU recovery action changed from 0x0 (None) to 0x2
(Node Reboot Required)"): ``xid154_need`` reads it; it overrides the table as NVML's recovery action does.
A code not listed here is ``UNLISTED``: shown, never a refusal on its own (the recovery action covers the driver's view).
"""

from __future__ import annotations

import re
from enum import IntEnum

from pvegpu.core.model import RECOVERY_ACTIONS


class Need(IntEnum):
    """What a GPU needs, ordered: the worst of several facts wins."""

    NOTHING = 0
    WATCH = 1
    APPLICATION = 2
    UNLISTED = 3
    RESET = 4
    REBOOT = 5

    @property
    def word(self) -> str:
        return {Need.NOTHING: "nothing", Need.WATCH: "watch", Need.APPLICATION: "application error", Need.UNLISTED: "unlisted",
                Need.RESET: "needs a GPU reset", Need.REBOOT: "needs a reboot"}[self]


# code -> (need, what the driver means), NVIDIA's mnemonic shortened
XIDS: dict[int, tuple[Need, str]] = {
    8: (Need.APPLICATION, "GPU stopped processing (channel idle timeout)"),
    13: (Need.APPLICATION, "graphics engine exception"),
    31: (Need.APPLICATION, "GPU memory page fault"),
    32: (Need.APPLICATION, "invalid or corrupted push buffer stream"),
    43: (Need.APPLICATION, "GPU stopped processing (reset channel verification error)"),
    45: (Need.APPLICATION, "preemptive cleanup, due to a previous error"),
    48: (Need.RESET, "double-bit ECC error (DBE)"),
    61: (Need.RESET, "internal micro-controller breakpoint/warning"),
    62: (Need.RESET, "internal micro-controller halt"),
    63: (Need.RESET, "ECC page retirement or row remapping recorded (takes effect at the next GPU reset)"),
    64: (Need.RESET, "ECC page retirement or row remapping failed"),
    68: (Need.APPLICATION, "video decoder exception"),
    69: (Need.APPLICATION, "graphics engine class error"),
    74: (Need.RESET, "NVLink error"),
    79: (Need.REBOOT, "GPU has fallen off the bus"),
    92: (Need.WATCH, "high single-bit ECC error rate"),
    94: (Need.APPLICATION, "contained ECC error (the application that met it was stopped)"),
    95: (Need.RESET, "uncontained ECC error"),
    109: (Need.APPLICATION, "context switch timeout"),
    119: (Need.RESET, "GSP RPC timeout"),
    120: (Need.RESET, "GSP error"),
    121: (Need.RESET, "C2C link error"),
    140: (Need.RESET, "unrecovered ECC error"),
    143: (Need.RESET, "GPU initialization failure"),
}

_XID154_TO = re.compile(r"to\s+0x([0-9a-fA-F]+)\s*\(([^)]*)\)")


def classify(code: int, text: str = "") -> Need:
    """The catalogue's need for Xid ``code`` (its text read for Xid 154)."""
    if code == 154:
        return xid154_need(text)
    return XIDS.get(code, (Need.UNLISTED, ""))[0]


def describe(code: int) -> str:
    """What Xid ``code`` means, in a few words ("" when not listed)."""
    if code == 154:
        return "GPU recovery action changed"
    return XIDS.get(code, (Need.UNLISTED, ""))[1]


def xid154_need(text: str) -> Need:
    """Xid 154's new recovery action: its value is NVML's recovery action (``core.model.RECOVERY_ACTIONS``), judged as
    NVML's is (``recovery_need``); 0 (None) needs nothing (the driver cleared it); a value or text not known -> REBOOT
    (the one action that covers every other)."""
    m = _XID154_TO.search(text)
    if m is None:
        return Need.REBOOT
    value, name = int(m.group(1), 16), m.group(2).lower()
    if value == 0 or name.strip() == "none":
        return Need.NOTHING
    return recovery_need(RECOVERY_ACTIONS.get(value, f"unknown-{value}"))


# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION by pvegpu's name (``core.model.RECOVERY_ACTIONS``) -> what the GPU needs
RECOVERY_NEEDS: dict[str, Need] = {"none": Need.NOTHING, "gpu-reset": Need.RESET, "drain-p2p": Need.RESET,
                                   "drain-and-reset": Need.RESET, "bus-reset": Need.RESET, "recover-imex-domain": Need.RESET,
                                   "node-reboot": Need.REBOOT, "system-reboot": Need.REBOOT}


def recovery_need(action: str) -> Need:
    """NVML's recovery action as a need; an action pvegpu does not know ("unknown-N") needs a reboot (it covers all)."""
    return RECOVERY_NEEDS.get(action, Need.REBOOT)
