"""The real NVML health reader against `nvidia-smi -q` on a GPU node: READ-ONLY (never `nvidia-smi -r`, never a
change of persistence mode). Marker ``gpu``: skipped without NVML, nvidia-smi or root. The kernel-log reader's
real-node test is in test_health.py."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from pvegpu.adapters.nvml import NvmlProbe
from tests.test_gpu import _nvml_ok

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _nvml_ok(), reason="no NVIDIA GPU/NVML here (runs on the device machine)"),
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no nvidia-smi to compare with"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (as pvegpu runs on a node)"),
]


def _smi_q(uuid: str, *display: str) -> dict[tuple[str, ...], str]:
    """``nvidia-smi -q -i UUID [-d ...]`` (reads only) as {path of headings and key: value}, by indentation."""
    args = ["nvidia-smi", "-q", "-i", uuid] + (["-d", ",".join(display)] if display else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
    fields: dict[tuple[str, ...], str] = {}
    stack: list[tuple[int, str]] = []
    for line in out.splitlines():
        if not line.strip() or line.startswith("=") or not line.startswith("    "):
            continue  # the banner, the timestamp, "GPU 00000000:..."
        indent = len(line) - len(line.lstrip())
        key, sep, value = line.strip().partition(":")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = tuple(k for _, k in stack) + (key.strip(),)
        if sep and value.strip():
            fields[path] = value.strip()
        else:
            stack.append((indent, key.strip()))
    return fields


def _flag(text: str | None) -> bool | None:
    """nvidia-smi's Yes / No / N/A (Enabled / Disabled) as True / False / None."""
    return {"yes": True, "enabled": True, "no": False, "disabled": False}.get((text or "n/a").lower())


def _gpus():
    with NvmlProbe(details=True) as p:
        return [(g, p.health(g.minor)) for g in p.gpus()]


def test_nvml_health_agrees_with_nvidia_smi_ecc_page_retirement_and_row_remapper():
    """Volatile uncorrectable ECC, row remapping pending/failed and retired pages pending read through NVML are what
    `nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER` prints (N/A there is None here: unknown, never healthy)."""
    for g, h in _gpus():
        q = _smi_q(g.uuid, "ECC", "PAGE_RETIREMENT", "ROW_REMAPPER")
        volatile = {k[-1]: v for k, v in q.items() if k[:2] == ("ECC Errors", "Volatile")}
        if not volatile or all(v == "N/A" for v in volatile.values()):
            assert h.ecc_volatile_uncorrected is None, (g, h, volatile)
        else:
            dram = int(volatile.get("DRAM Uncorrectable", volatile.get("Double Bit", 0) or 0))
            every = sum(int(v) for k, v in volatile.items() if "Uncorrectable" in k and v.isdigit())
            assert h.ecc_volatile_uncorrected is not None and dram <= h.ecc_volatile_uncorrected <= max(every, dram), (g, h, volatile)
        assert h.remap_pending is _flag(q.get(("Remapped Rows", "Pending"))), (g, h, q)
        assert h.remap_failed is _flag(q.get(("Remapped Rows", "Remapping Failure Occurred"))), (g, h, q)
        assert h.retired_pages_pending is _flag(q.get(("Retired Pages", "Pending Page Blacklist"))), (g, h, q)


def test_nvml_recovery_action_and_persistence_mode_agree_with_nvidia_smi():
    """NVML's recovery action is nvidia-smi's "GPU Recovery Action" (None there is "none" here; absent or N/A: None),
    and persistence mode is its "Persistence Mode"."""
    for g, h in _gpus():
        q = _smi_q(g.uuid)
        said = q.get(("GPU Recovery Action",))
        if said is None or said == "N/A":
            assert h.recovery_action is None, (g, h)
        elif said == "None":
            assert h.recovery_action == "none", (g, h)
        else:
            assert h.recovery_action not in (None, "none"), (g, h, said)
        assert h.persistence_mode is _flag(q.get(("Persistence Mode",))), (g, h, q.get(("Persistence Mode",)))


def test_nvlinks_answers_a_count_or_unknown_where_nvml_does_not_support_it():
    """NvmlProbe.nvlinks() answers without an error: a count of active links, or None (unknown) where NVML says
    NotSupported for the first link."""
    import pynvml

    with NvmlProbe() as p:
        for g in p.gpus():
            links = p.nvlinks(g.minor)
            pynvml.nvmlInit()
            try:
                pynvml.nvmlDeviceGetNvLinkState(pynvml.nvmlDeviceGetHandleByUUID(g.uuid), 0)
                supported = True
            except pynvml.NVMLError as exc:
                supported = exc.value != pynvml.NVML_ERROR_NOT_SUPPORTED
            finally:
                pynvml.nvmlShutdown()
            assert (links is None) if not supported else (links is None or links >= 0), (g, links)
            if supported:
                assert links is not None and 0 <= links <= pynvml.NVML_NVLINK_MAX_LINKS, (g, links)
