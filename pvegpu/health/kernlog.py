"""The kernel log as health facts (pure): records in, Xid and reset events per GPU out.

Record source: ``/dev/kmsg`` (``adapters/kernlog.py``; the simulated node's ``kmsg`` file in the same format), one
record a line: ``PRIO,SEQ,USEC,FLAGS;TEXT`` where TEXT escapes unprintable bytes as ``\\xNN`` (a newline in a
multi-line message is ``\\x0a``); lines beginning with a space are the record's dictionary (``SUBSYSTEM=pci``).

What is read (the driver's formats; fixtures in ``tests/test_health.py``):

- ``NVRM: Xid (PCI:0000:41:00): 79, pid=1234, name=python3, GPU has fallen off the bus.`` (older drivers print
  ``NVRM: Xid (0000:41:00): 79, ...``, some no ``pid=`` at all): an Xid of that GPU;
- ``NVRM: GPU 0000:41:00.0: GPU has fallen off the bus.`` and the multi-line ``NVRM: The NVIDIA GPU 0000:41:00.0
  (PCI ID: 10de:2330) installed in this system has fallen off the bus ...``: Xid 79 of that GPU, even without an Xid line;
- a GPU reset: pvegpu's own record (``reset_record``, written by ``pvegpu gpu-reset`` once it verified the reset) and
  NVSentinel's ``GPU reset executed: GPU-<uuid>`` (by UUID); Xid 154 "to 0x0 (None)" (the driver cleared the action) counts too.

A GPU is named by its PCI bus id, normalised (``bus_key``): domain, bus and device, lower case, no function.
Order is the log's (its sequence numbers), never wall time.

Who wrote a record matters: a tenant gets its own text into kernel records (a mount option the kernel rejects is
printed back, ``tmpfs: Unknown parameter '...'``), so the driver's lines count only as the kernel's own records (PRIO's
facility 0) that begin with ``NVRM:``, and a reset only as a userspace record (the kernel gives every ``/dev/kmsg``
write a facility other than 0, "to reliably distinguish kernel-generated messages from userspace-injected ones").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from pvegpu.health.catalogue import Need, classify

_BUS = r"(?:PCI:)?([0-9a-fA-F]{1,8}:[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}(?:\.[0-7])?)"
_XID = re.compile(r"NVRM: Xid \(" + _BUS + r"\): (\d+)(?:,|$)\s*(.*)", re.S)
_FALLEN_ONE = re.compile(r"NVRM: GPU " + _BUS + r": GPU has fallen off the bus")
_FALLEN_MANY = re.compile(r"NVRM: The NVIDIA GPU " + _BUS + r"\b.*?fallen\s+off\s+the\s+bus", re.S)
_NVSENTINEL_RESET = re.compile(r"GPU reset executed: (GPU-[0-9a-fA-F-]+)(?:, success: (\w+))?")
_PVEGPU_RESET = re.compile(r"pvegpu: GPU reset verified: PCI:" + _BUS + r"(?: (GPU-[0-9a-fA-F-]+))?")
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
_HEAD = re.compile(r"(\d+),(\d+),(\d+),[^;]*;")
KERNEL = 0  # the facility of the kernel's own records (PRIO >> 3)
SAME_EVENT = 8  # records: a "fallen off the bus" line this close after an Xid 79 of that GPU is the same event
KEYWORDS = ("NVRM", "GPU reset")  # a record without one of these is not read further (most of the log)


def bus_key(bus_id: str) -> str | None:
    """``00000000:41:00.0``, ``0000:41:00.0``, ``PCI:0000:41:00``, ``41:00.0`` -> ``0000:41:00``; None when no bus id."""
    text = bus_id.strip().removeprefix("PCI:").split(".")[0]
    parts = text.split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3:
        return None
    try:
        domain, bus, dev = (int(p, 16) for p in parts)
    except ValueError:
        return None
    return f"{domain:04x}:{bus:02x}:{dev:02x}"


def reset_record(bus_id: str, uuid: str = "") -> str:
    """The kernel log record ``pvegpu gpu-reset`` writes once a GPU reset is verified: it ends that GPU's Xids."""
    return f"pvegpu: GPU reset verified: PCI:{bus_key(bus_id) or bus_id}.0" + (f" {uuid}" if uuid else "")


@dataclass(frozen=True)
class XidEvent:
    """One Xid the driver logged for one GPU (``fallen off the bus`` without an Xid line is Xid 79)."""

    bus: str  # bus_key
    code: int
    seq: int  # the record's place in the log: later is newer
    at_us: int | None  # microseconds since boot (the record's timestamp)
    text: str  # the rest of the line (host-side, still escaped before it is shown)
    need: Need

    def to_json(self) -> dict[str, object]:
        return {"code": self.code, "seconds_since_boot": None if self.at_us is None else round(self.at_us / 1e6, 3),
                "need": self.need.name.lower(), "text": self.text}


@dataclass(frozen=True)
class ResetEvent:
    """A GPU reset the log records (by bus or, NVSentinel's, by UUID)."""

    seq: int
    at_us: int | None
    bus: str | None = None
    uuid: str | None = None


@dataclass(frozen=True)
class KernelEvents:
    """What the kernel log since boot says of the GPUs; ``error`` set: it could not be read (unknown, never "no Xid").
    ``complete``: the log was read from this boot's first record (the ring buffer had not wrapped, nothing was cut off)."""

    xids: tuple[XidEvent, ...] = ()
    resets: tuple[ResetEvent, ...] = ()
    error: str | None = None
    complete: bool = False
    first_us: int | None = None  # the oldest record read (when not complete: what came before is gone)
    forgeable: bool = False  # containers' firewalls may write kernel records too (nf_log_all_netns): an Xid alone is not proof

    @property
    def read(self) -> bool:
        return self.error is None

    def of(self, bus_id: str, uuid: str = "") -> tuple[list[XidEvent], list[ResetEvent]]:
        """This GPU's Xids and resets (``bus_id`` in any form, ``uuid`` for resets logged by UUID)."""
        key = bus_key(bus_id)
        xids = [x for x in self.xids if key is not None and x.bus == key]
        resets = [r for r in self.resets if (key is not None and r.bus == key) or (uuid and r.uuid == uuid)]
        return xids, resets


@dataclass
class Record:
    """One kernel log record: its sequence number, its time (µs since boot) and its text (unescaped)."""

    seq: int
    at_us: int | None
    text: str
    dictionary: list[str] = field(default_factory=list)
    facility: int = KERNEL  # PRIO >> 3: 0 the kernel's own, else written from userspace


def unescape(text: str) -> str:
    """``/dev/kmsg``'s ``\\xNN`` escapes back to the bytes they stand for (a newline in a multi-line message)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)


def parse_record(line: str) -> Record | None:
    """One ``PRIO,SEQ,USEC,FLAGS;TEXT`` line; None when it is not one (a dictionary line, garbage)."""
    m = _HEAD.match(line)
    if m is None:
        return None
    return Record(int(m.group(2)), int(m.group(3)), unescape(line[m.end():].rstrip("\n")), facility=int(m.group(1)) >> 3)


def events(records: Iterable[Record]) -> tuple[list[XidEvent], list[ResetEvent]]:
    """The Xids and resets in ``records`` (any order in, log order out)."""
    xids: list[XidEvent] = []
    resets: list[ResetEvent] = []
    for r in records:
        text = r.text
        if not any(k in text for k in KEYWORDS):
            continue
        if r.facility != KERNEL:
            if m := _PVEGPU_RESET.match(text):
                resets.append(ResetEvent(r.seq, r.at_us, bus_key(m.group(1)), m.group(2)))
            elif (m := _NVSENTINEL_RESET.search(text)) and (m.group(2) or "true").lower() == "true":
                resets.append(ResetEvent(r.seq, r.at_us, None, m.group(1)))
            continue
        if m := _XID.match(text):
            key, code, rest = bus_key(m.group(1)), int(m.group(2)), m.group(3).strip()
            if key is None:
                continue
            need = classify(code, rest)
            if code == 154 and need is Need.NOTHING:  # the driver says no recovery action is needed any more
                resets.append(ResetEvent(r.seq, r.at_us, key))
            xids.append(XidEvent(key, code, r.seq, r.at_us, rest, need))
        elif (m := _FALLEN_ONE.match(text)) or (m := _FALLEN_MANY.match(text)):
            key = bus_key(m.group(1))
            last = next((x for x in reversed(xids) if x.bus == key), None)
            if last is not None and last.code == 79 and r.seq - last.seq <= SAME_EVENT:
                continue  # the line the driver prints after its Xid 79: one event, counted once
            if key is not None:
                xids.append(XidEvent(key, 79, r.seq, r.at_us, " ".join(text.split()), Need.REBOOT))
    xids.sort(key=lambda x: x.seq)
    resets.sort(key=lambda x: x.seq)
    return xids, resets


def parse_lines(lines: Iterable[str]) -> tuple[list[XidEvent], list[ResetEvent]]:
    """``events`` of ``/dev/kmsg`` lines (dictionary lines skipped)."""
    return events(r for line in lines if (r := parse_record(line)) is not None)
