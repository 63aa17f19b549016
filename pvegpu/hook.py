"""``pvegpu check`` and ``pvegpu hook VMID PHASE``: the start gate's fast path.

PVE runs a guest's hookscript as ``<script> <vmid> <phase>`` with ``PATH=/sbin:/bin:/usr/sbin:/usr/bin``,
``LC_ALL=C``, stdin ``/dev/null``, no timeout, while it holds the container's config lock; a non-zero
``pre-start`` aborts the start. So this module imports no typer, rich, proxmoxer or structlog, never calls
the API or ``pct``, reads ``/etc/pve`` directly, and bounds itself with its own deadline.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from dataclasses import dataclass

from . import errors as E
from .gate import GateDecision, GatePolicy, decide, paragraph
from .inspect import inspect_gpus
from .locate import check_vmid, find_guest, granted_gpus
from .lxcconf import parse_config
from .model import MIB, GpuInfo, GpuSample
from .settings import Settings, load

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:
    from typing import Any, TextIO

PHASES = ("pre-start", "post-start", "pre-stop", "post-stop")


@dataclass
class CheckResult:
    vmid: int
    decision: GateDecision
    gpus: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        d = self.decision
        return {"vmid": self.vmid, "allow": d.allow, "reasons": d.reasons, "fix": list(dict.fromkeys(d.fix)), "gpus": self.gpus}


class _Unreadable:
    """A GpuProbe for when NVML itself cannot start: every GPU is unknown, never zero."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def gpus(self) -> list[GpuInfo]:
        return []

    def sample(self, minors: Any) -> dict[int, GpuSample]:
        return {m: GpuSample(m, None, None, self.reason) for m in minors}


def _ports(s: Settings) -> tuple[Any, Any, Any]:
    if s.simulate:
        from .sim.scenario import SimNode

        return SimNode(s.simulate).ports()
    from .adapters.etcpve import EtcPve
    from .adapters.procfs import ProcHost

    try:
        from .adapters.nvml_lite import NvmlLite

        probe: Any = NvmlLite()
    except E.GpuQueryError as exc:
        probe = _Unreadable(exc.message)
    return EtcPve(s.pve_root, node=s.node), probe, ProcHost()


def check(vmid: int, s: Settings) -> CheckResult:
    """Decide whether CT ``vmid`` may start now (reads /etc/pve, NVML and /proc only)."""
    pve, probe, host = _ports(s)
    guest = find_guest(vmid, pve)
    conf = parse_config(pve.ct_config(guest))
    if not conf.gpus.minors and not conf.gpus.all_gpus:
        return CheckResult(vmid, GateDecision(True, ["no NVIDIA GPU in its configuration"]), [])
    if isinstance(probe, _Unreadable):
        gpus = [GpuInfo(-1, m, "?", "?") for m in sorted(conf.gpus.minors)] or [GpuInfo(-1, -1, "all GPUs", "?")]
    else:
        gpus = list(granted_gpus(conf, probe.gpus())[0])
    policy = GatePolicy(s.gate.threshold_mib * MIB, s.gate.on_unknown,
                        vmid in s.gate.exclusive or s.gate.exclusive_tag in conf.tags)
    pids = host.ct_pids(vmid)
    facts = inspect_gpus(vmid, gpus, host=host, probe=probe, ct_pids=pids)
    decision = decide(vmid, facts, pids, policy)
    rows = [{"index": f.gpu.index, "minor": m, "uuid": f.gpu.uuid, "state": decision.per_gpu.get(m),
             "used_mib": None if f.used_bytes is None else round(f.used_bytes / MIB),
             "shared_with": sorted({h.info.placement.vmid for h in f.other_holders if h.info.placement.vmid}),
             "ghost_pids": f.ghosts} for m, f in sorted(facts.items())]
    return CheckResult(vmid, decision, rows)


def _bounded(fn: Any, deadline: float) -> tuple[bool, Any]:
    """Run ``fn`` in a forked child; (finished, its JSON-able result). The child's stdout/stderr go to
    /dev/null and its answer comes over a private pipe, so a child stuck in the driver (D state) holds
    neither this process nor PVE's output pipe: on expiry we answer, kill it, and exit."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            try:
                out = {"ok": fn()}
            except E.PvegpuError as exc:
                out = {"error": [type(exc).__name__, exc.message, exc.hint, exc.exit_code]}
            except BaseException as exc:  # noqa: BLE001 - reported by the parent
                out = {"crash": f"{type(exc).__name__}: {exc}"}
            os.write(w, json.dumps(out).encode())
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    end = time.monotonic() + deadline
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
                return False, None
            data = os.read(r, 65536)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(r)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    if not chunks:
        return True, {"crash": "the check ended without an answer"}
    return True, json.loads(b"".join(chunks))


def _verdict(vmid: int, phase: str, s: Settings) -> dict[str, Any]:
    """The hook's answer as plain data (so it can cross the pipe from the child)."""
    if phase == "post-stop":
        return {"code": E.EXIT_OK, "out": _post_stop(vmid, s), "err": ""}
    res = check(vmid, s)
    text = paragraph(vmid, res.decision)
    if res.decision.allow:
        return {"code": E.EXIT_OK, "out": text, "err": ""}
    return {"code": E.EXIT_REFUSED, "out": "", "err": text}


def allow_once(vmid: int, s: Settings) -> str:
    """Let the next start of CT ``vmid`` through the gate once (a token file, valid ``gate.override_ttl`` s)."""
    os.makedirs(s.gate.override_dir, mode=0o700, exist_ok=True)
    path = os.path.join(s.gate.override_dir, str(vmid))
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{time.time():.0f} uid={os.getuid()}\n")
    return path


def _take_override(vmid: int, s: Settings) -> str | None:
    """Consume CT vmid's one-start token if there is a fresh one; returns its description."""
    path = os.path.join(s.gate.override_dir, str(vmid))
    try:
        age = time.time() - os.stat(path).st_mtime
        os.unlink(path)
    except OSError:
        return None
    if age > s.gate.override_ttl:
        return None
    return f"{path}, {age:.0f} s old"


def run_hook(vmid_text: str, phase: str, s: Settings, out: TextIO, err: TextIO) -> int:
    """One hookscript invocation; returns the exit code PVE sees."""
    if phase not in PHASES:
        raise E.UsageError(f"unknown hook phase '{phase}'", f"PVE calls hookscripts with one of: {', '.join(PHASES)}")
    vmid = check_vmid(vmid_text)
    if phase not in ("pre-start", "post-stop"):
        return E.EXIT_OK
    out.flush()
    err.flush()
    start = phase == "pre-start"
    override = _take_override(vmid, s) if start else None
    done, res = _bounded(lambda: _verdict(vmid, phase, s), s.gate.deadline)
    if override:
        why = res["ok"]["err"] if done and "ok" in res else ("" if done else "the check did not finish in time")
        print(f"pvegpu: CT {vmid} allowed to start ONCE by an override ({override})" + (f"; it would have refused: {why}" if why else ""), file=out)
        return E.EXIT_OK
    if not done:
        if start:
            print(f"pvegpu: refusing to start CT {vmid}: the GPU check did not finish within {s.gate.deadline:g} s "
                  "(NVML hung? see `nvidia-smi`, `dmesg | grep -i xid`); raise gate.deadline if the node is just slow.", file=err)
            return E.EXIT_REFUSED
        print(f"pvegpu: post-stop check of CT {vmid} did not finish within {s.gate.deadline:g} s", file=err)
        return E.EXIT_OK
    if "ok" in res:
        v = res["ok"]
        if v["out"]:
            print(v["out"], file=out)
        if v["err"]:
            print(v["err"], file=err)
        return int(v["code"])
    if "error" in res:
        _name, message, hint, _code = res["error"]
        what = f"refusing to start CT {vmid}" if start else f"post-stop check of CT {vmid}"
        print(f"pvegpu: {what}: {message}" + (f" (hint: {hint})" if hint else ""), file=err)
        return E.EXIT_REFUSED if start else E.EXIT_OK
    print(f"pvegpu: {'refusing to start' if start else 'post-stop check of'} CT {vmid}: internal error: {res['crash']}", file=err)
    return E.EXIT_REFUSED if start else E.EXIT_OK


def _post_stop(vmid: int, s: Settings) -> str:
    res = check(vmid, s)
    if res.decision.allow:
        return f"pvegpu: CT {vmid} stopped; its GPUs are clean."
    msg = f"pvegpu: CT {vmid} stopped, GPUs NOT clean: " + "; ".join(res.decision.reasons)
    if s.gate.post_stop_reclaim:
        from .adapters.clock import SystemClock
        from .reclaim import Ports, ResetPolicy, reset

        pve, probe, host = _ports(s)
        rep = reset(vmid, Ports(pve, probe, host, SystemClock()), ResetPolicy(restart=False, grace=min(s.reset.grace, 2.0),
                                                                          timeout=min(s.reset.timeout, 2.0)))
        msg += f"; post-stop reclaim: {rep.outcome}"
    return msg


def main_fast(argv: list[str]) -> int:
    """Entry for ``pvegpu hook VMID PHASE`` and ``pvegpu check VMID [--json]`` without the full CLI."""
    try:
        s = load()
        if argv[0] == "hook":
            if len(argv) != 3:
                raise E.UsageError("usage: pvegpu hook VMID PHASE", "PVE calls it as `<script> <vmid> <phase>`")
            return run_hook(argv[1], argv[2], s, sys.stdout, sys.stderr)
        args = [a for a in argv[1:] if not a.startswith("-")]
        if len(args) != 1 or any(a not in ("--json",) for a in argv[1:] if a.startswith("-")):
            raise E.UsageError("usage: pvegpu check VMID [--json]", None)
        res = check(check_vmid(args[0]), s)
        if "--json" in argv:
            print(json.dumps(res.to_json(), indent=2))
        else:
            print(paragraph(res.vmid, res.decision))
        return E.EXIT_OK if res.decision.allow else E.EXIT_REFUSED
    except E.PvegpuError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"Hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
