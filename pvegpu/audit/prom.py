"""``pvegpu audit --prometheus FILE``: the audit as a node_exporter textfile (``adapters/textfile`` writes it).

Conventions follow Prometheus and prometheus-pve-exporter: prefix ``pvegpu_``, base units (``_bytes``),
identity in ``_info`` gauges, GPU values labelled ``uuid`` + ``minor``, guests labelled ``id="lxc/129"`` and
``node`` (so ``* on(id, node) group_left(name) max by (id, node, name) (pve_guest_info)`` joins). Unknown readings are absent, never 0.
Series are bounded: anomalies are counts per GPU or per flag kind, never one series per pid.
Manual equivalent: ``curl -s localhost:9100/metrics | grep ^pvegpu_`` once node_exporter reads the directory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from pvegpu.audit.model import FlagKind

G = ["node", "uuid", "minor"]
GUEST = ["node", "id", "uuid", "minor"]


class AuditCollector:
    """Turns the audit JSON document into metric families (a prometheus_client collector)."""

    def __init__(self, doc: Mapping[str, Any], last_success: Mapping[str, float] | None = None) -> None:
        self.doc = doc
        self.last_success = dict(last_success or {})

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam: dict[str, GaugeMetricFamily] = {}

        def g(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            if name not in fam:
                fam[name] = GaugeMetricFamily(name, doc, labels=labels)
            return fam[name]

        up = g("pvegpu_audit_up", "1 when the node's GPUs could be audited (NVML read, node reached)", ["node"])
        att = g("pvegpu_audit_attention", "1 when a flag of the node needs attention (exit code 8)", ["node"])
        dur = g("pvegpu_audit_duration_seconds", "time the node's audit took", ["node"])
        last = g("pvegpu_audit_last_success_timestamp_seconds", "unix time of the node's last audit that read its GPUs", ["node"])
        flags = g("pvegpu_audit_flags", "findings of the last audit per kind (see `pvegpu audit`)", ["node", "kind"])
        for n in self.doc.get("nodes", []):
            node = str(n.get("node", ""))
            ok = bool(n.get("ok"))
            up.add_metric([node], 1.0 if ok else 0.0)
            att.add_metric([node], 1.0 if n.get("attention") else 0.0)
            if n.get("duration_seconds") is not None:
                dur.add_metric([node], float(n["duration_seconds"]))
            when = float(self.doc.get("generated_at", 0)) if ok else self.last_success.get(node)
            if when is not None:
                last.add_metric([node], when)
            counts = {k.value: 0 for k in FlagKind}
            for f in n.get("flags", []):
                counts[f["kind"]] = counts.get(f["kind"], 0) + 1
            for kind, c in counts.items():
                flags.add_metric([node, kind], float(c))
            self._gpus(node, n, g)
            self._guests(node, n, g)
        yield from fam.values()

    @staticmethod
    def _gpus(node: str, n: Mapping[str, Any], g: Any) -> None:
        info = g("pvegpu_gpu_info", "a GPU of the node (identity)", ["node", "uuid", "index", "minor", "bus_id", "name", "driver_version"])
        gup = g("pvegpu_gpu_up", "1 when NVML could read the GPU", G)
        values = {
            "total_bytes": g("pvegpu_gpu_memory_total_bytes", "GPU memory size", G),
            "used_bytes": g("pvegpu_gpu_memory_used_bytes", "GPU memory allocated (NVML memory v2 used)", G),
            "reserved_bytes": g("pvegpu_gpu_memory_reserved_bytes", "GPU memory reserved by the driver (NVML memory v2)", G),
            "unattributed_bytes": g("pvegpu_gpu_memory_unattributed_bytes",
                                    "GPU memory no live process accounts for, net of the per-context allowance", G),
            "residual_bytes": g("pvegpu_gpu_memory_residual_bytes", "GPU memory no live process accounts for, before the allowance", G),
            "context_allowance_bytes": g("pvegpu_gpu_memory_context_allowance_bytes",
                                         "per-context overhead allowed for the live CUDA contexts (leftover.per_context_mib each)", G),
        }
        health = {
            "remap_pending": g("pvegpu_gpu_row_remap_pending", "1 when a row remapping waits for a GPU reset", G),
            "remap_failed": g("pvegpu_gpu_row_remap_failed", "1 when a row remapping failed", G),
            "retired_pages_pending": g("pvegpu_gpu_retired_pages_pending", "1 when page retirement waits for a GPU reset", G),
            "mig_enabled": g("pvegpu_gpu_mig_enabled", "1 when MIG mode is on", G),
        }
        outside = g("pvegpu_gpu_outside_holders", "live processes outside any guest (host, monitor, unknown) that may own a context on "
                    "the GPU (NVML lists them, or they map it while a dead listed pid is unexplained)", G)
        clients = g("pvegpu_gpu_nvml_clients", "live processes outside any guest that NVML does not list, with the GPU open (NVML clients: "
                    "nvidia-persistenced, DCGM, exporters; informational)", G)
        state = g("pvegpu_gpu_health", "1 for the GPU's health verdict (ok, needs-gpu-reset, needs-reboot, lost, unknown; docs/health.md), "
                  "0 for the others", [*G, "state"])
        action = g("pvegpu_gpu_recovery_action", "1 for NVML's recovery action (none, gpu-reset, node-reboot, ...); absent where the "
                   "driver does not report it", [*G, "action"])
        xids = g("pvegpu_gpu_xids", "Xids the kernel log holds for the GPU since its last reset (or boot), by code and need", [*G, "code", "need"])
        ecc = g("pvegpu_gpu_ecc_volatile_uncorrected", "uncorrected ECC errors since the driver loaded (volatile)", G)
        dead = g("pvegpu_gpu_dead_pids", "pids NVML lists on the GPU that no longer exist", G)
        granted = g("pvegpu_gpu_granted_guests", "guests whose configuration grants the GPU", G)
        seen: set[tuple[str, ...]] = set()
        for gpu in n.get("gpus", []):
            key = [node, str(gpu["uuid"]), _minor(gpu)]
            if tuple(key) in seen:  # two GPUs NVML could not name (uuid and minor "?"): one series, never a duplicate
                continue
            seen.add(tuple(key))
            info.add_metric([node, str(gpu["uuid"]), str(gpu["index"]), _minor(gpu), str(gpu["bus_id"]), str(gpu["name"]),
                             str(gpu.get("driver_version") or "")], 1.0)
            readable = bool(gpu.get("readable", True))
            gup.add_metric(key, 1.0 if readable else 0.0)
            if gpu.get("total_bytes") is not None:
                values["total_bytes"].add_metric(key, float(gpu["total_bytes"]))
            granted.add_metric(key, float(len(gpu.get("granted_to", []))))
            if not readable:
                continue
            for field_name, fam in values.items():
                if field_name != "total_bytes" and gpu.get(field_name) is not None:
                    fam.add_metric(key, float(gpu[field_name]))
            for field_name, fam in health.items():
                v = gpu.get("health", {}).get(field_name)
                if v is not None:
                    fam.add_metric(key, 1.0 if v else 0.0)
            _health(key, gpu.get("health", {}), state, action, xids, ecc)
            out = [h for h in gpu.get("holders", []) if h.get("place") not in ("lxc", "qemu")]
            owners = sum(1 for h in out if h.get("may_own_context", bool({"nvml", "maps"} & set(h.get("via", [])))))
            outside.add_metric(key, float(owners))
            clients.add_metric(key, float(len(out) - owners))
            dead.add_metric(key, float(len(gpu.get("dead_pids", []))))

    @staticmethod
    def _guests(node: str, n: Mapping[str, Any], g: Any) -> None:
        mem = g("pvegpu_guest_gpu_memory_used_bytes", "GPU memory NVML attributes to the guest's processes (0: a running GPU guest holding none)", GUEST)
        procs = g("pvegpu_guest_gpu_processes", "live processes of the guest holding the GPU", GUEST)
        pci = g("pvegpu_guest_pci_passthrough_info", "a PCI device a VM's hostpci names, with the host driver bound now", ["node", "id", "bus_id", "driver"])
        running = {c["id"] for c in n.get("guests", []) if c.get("status") == "running"}
        for gpu in n.get("gpus", []):
            if not gpu.get("readable", True):
                continue
            key = [str(gpu["uuid"]), str(gpu["minor"])]
            per: dict[str, tuple[int | None, int]] = {gid: (0, 0) for gid in gpu.get("granted_to", []) if gid in running}
            for h in gpu.get("holders", []):
                gid = h.get("id")
                if not gid:
                    continue
                total, count = per.get(gid, (0, 0))
                used = h.get("used_bytes") if "nvml" in h.get("via", []) else (
                    h.get("credited_bytes") if h.get("inherited_from") is not None else 0)
                per[gid] = (None if total is None or used is None else total + int(used), count + 1)
            for gid, (total, count) in sorted(per.items()):
                procs.add_metric([node, gid, *key], float(count))
                if total is not None:
                    mem.add_metric([node, gid, *key], float(total))
        drift = g("pvegpu_guest_driver_mismatch", "1 when a running container's NVIDIA user-space libraries are not the host kernel "
                  "module's version (its next CUDA start fails), 0 when they are; absent when unknown", ["node", "id"])
        for c in n.get("guests", []):
            state = (c.get("driver") or {}).get("state")
            if state in ("match", "mismatch"):
                drift.add_metric([node, str(c["id"])], 1.0 if state == "mismatch" else 0.0)
        for p in n.get("passthrough", []):
            pci.add_metric([node, str(p["id"]), str(p["bus_id"]), "unknown" if p.get("driver") is None else str(p["driver"] or "none")], 1.0)

    def describe(self) -> list[GaugeMetricFamily]:
        return []


HEALTH_STATES = ("ok", "needs-gpu-reset", "needs-reboot", "lost", "unknown")


def _health(key: list[str], h: Mapping[str, Any], state: Any, action: Any, xids: Any, ecc: Any) -> None:
    """The health verdict (one series per state, 1 for the current), NVML's recovery action, Xid counts by code."""
    if h.get("recovery_action") is not None:
        action.add_metric([*key, str(h["recovery_action"])], 1.0)
    if h.get("ecc_volatile_uncorrected") is not None:
        ecc.add_metric(key, float(h["ecc_volatile_uncorrected"]))
    verdict = h.get("verdict")
    if not verdict:
        return
    for name in HEALTH_STATES:
        state.add_metric([*key, name], 1.0 if verdict.get("state") == name else 0.0)
    counts: dict[tuple[str, str], int] = {}
    for x in list(verdict.get("xids", [])) + list(verdict.get("application_xids", [])):
        k = (str(x.get("code")), str(x.get("need")))
        counts[k] = counts.get(k, 0) + 1
    for (code, need), n in sorted(counts.items()):
        xids.add_metric([*key, code, need], float(n))


def _minor(gpu: Mapping[str, Any]) -> str:
    """The minor label: "?" for a GPU NVML could not name (its row has minor -1)."""
    return "?" if int(gpu.get("minor", -1)) < 0 else str(gpu["minor"])


def parse_last_success(text: str) -> dict[str, float]:
    """``pvegpu_audit_last_success_timestamp_seconds`` per node from the text the last run wrote (kept on failure)."""
    out: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name == "pvegpu_audit_last_success_timestamp_seconds":
                for s in fam.samples:
                    out[s.labels.get("node", "")] = float(s.value)
    except ValueError:
        return {}
    return out


def render(doc: Mapping[str, Any], last_success: Mapping[str, float] | None = None) -> bytes:
    reg = CollectorRegistry()
    reg.register(AuditCollector(doc, last_success))  # type: ignore[arg-type]
    return generate_latest(reg)
