"""Which GPU ``N`` names: an NVML index, a minor (``/dev/nvidiaN``), a UUID (or its prefix) or a PCI bus id."""

from __future__ import annotations

from pvegpu.core.errors import UsageError
from pvegpu.core.model import GpuInfo
from pvegpu.core.qemuconf import normalize_bus_id
from pvegpu.core.safetext import shown


def resolve(text: str, gpus: list[GpuInfo], lost: list[str] | None = None) -> GpuInfo:
    """The one GPU ``text`` names; an unknown or ambiguous id is a UsageError listing the GPUs that exist."""
    t = text.strip()
    hits: list[GpuInfo] = []
    if t.isascii() and t.isdigit():
        n = int(t)
        # an index and a minor are different numberings: a number that names one GPU by each is no GPU to reset on a guess
        hits = list({id(g): g for g in gpus if n in (g.index, g.minor)}.values())
    elif t.upper().startswith("GPU-") and len(t) >= 8:
        hits = [g for g in gpus if g.uuid.lower().startswith(t.lower())]
    elif (bus := normalize_bus_id(t)) is not None:
        hits = [g for g in gpus if normalize_bus_id(g.bus_id) == bus.replace(".*", ".0")]
    if len(hits) == 1:
        return hits[0]
    known = "; ".join(f"{g.index} (minor {g.minor}, {g.uuid}, {g.bus_id})" for g in gpus) or "none"
    gone = f"; NVML cannot read: {'; '.join(lost)}" if lost else ""
    what = "names more than one GPU" if hits else "is no GPU of this node"
    raise UsageError(f"{shown(t)!s} {what}: GPUs here are {known}{gone}",
                     "give the index, the minor (/dev/nvidiaN), the UUID or the PCI bus id (`nvidia-smi -L`)")
