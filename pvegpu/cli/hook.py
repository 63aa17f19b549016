"""The start gate's two ways in: ``pvegpu hook VMID PHASE`` (the hookscript) and ``pvegpu check VMID``.

PVE runs a guest's hookscript as ``<script> <vmid> <phase>`` with ``PATH=/sbin:/bin:/usr/sbin:/usr/bin``,
``LC_ALL=C``, stdin ``/dev/null``, no timeout, while it holds the container's config lock; a non-zero
``pre-start`` aborts the start. ``__main__`` hands those two words here straight from ``argv`` (PVE's calling
convention, not a command line): this module imports no typer, rich, proxmoxer or structlog, never calls the API
or ``pct``, and bounds the check with ``gate.deadline`` (it runs in a forked child). Its settings come from
``PVEGPU_CONFIG`` (or ``/etc/pvegpu/pvegpu.toml``) and the ``PVEGPU_*`` variables; a simulated node's start passes
its directory as ``PVEGPU_SIMULATE`` (``pvegpu/sim/pve.py``). ``pvegpu check`` (typer, ``pvegpu/cli/app.py``) runs
the same code path as the hook's ``pre-start``: the same bounded check, the same decision.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TextIO

from pvegpu import wiring
from pvegpu.adapters.child import Child
from pvegpu.adapters.override import pending, take
from pvegpu.core import errors as E
from pvegpu.core.contract import check_error_document, document, dumps
from pvegpu.core.ha import managed
from pvegpu.core.locate import check_vmid
from pvegpu.core.textfit import fit
from pvegpu.gate.decide import evaluate, paragraph
from pvegpu.gate.vm import vm_verdict

if TYPE_CHECKING:
    from pvegpu.core.settings import Settings

PHASES = ("pre-start", "post-start", "pre-stop", "post-stop")
HOOK_HINT = ("PVE runs the guard as `pvegpu-guard VMID PHASE`, no options: settings come from PVEGPU_CONFIG "
             "(default /etc/pvegpu/pvegpu.toml), a simulated node from PVEGPU_SIMULATE; `pvegpu check VMID` asks the same")


def _verdict(vmid: int, s: Settings) -> dict[str, Any]:
    """The check as plain data, so it can cross the pipe from the bounded child."""
    ports = wiring.gate_ports(s)
    guest = ports.pve.where(vmid)
    if guest is not None and guest.type == "qemu":  # a VM: pvegpu/gate/vm.py
        vm = vm_verdict(vmid, ports, wiring.gate_policy(s), lambda: wiring.gate_files(s))
        if vm is not None:
            return vm
    res = evaluate(vmid, ports, wiring.gate_policy(s))
    return {"allow": res.decision.allow, "text": paragraph(vmid, res.decision), "json": res.to_json()}


def start_check(vmid: int, opts: wiring.GlobalOptions) -> Child:
    """The check, started now in a forked child, before this process reads its settings: the child begins NVML's
    start beside its ``/etc/pve`` and ``/proc`` reads (``wiring.gate_ports``); ``gate.deadline`` counts from this
    fork (``collect``). The same settings are read on both sides."""
    def check() -> dict[str, Any]:
        return _verdict(vmid, wiring.settings(opts))

    return _fork(check)


def _fork(fn: Any) -> Child:
    """``Child(fn)``; no process or pipe left for it (EAGAIN, EMFILE) is a PvegpuError: the gate fails closed."""
    try:
        return Child(fn)
    except OSError as exc:
        raise E.GpuQueryError(f"the check's process could not be started: {exc.strerror or exc}",
                              "is the node out of processes or open files? see `dmesg`") from None


def collect(child: Child, s: Settings) -> dict[str, Any]:
    """The started check's verdict within ``gate.deadline``, or a PvegpuError for what went wrong."""
    done, ans = child.result(s.gate.deadline, reap=False)  # this process exits right after its verdict
    if not done or ans is None:
        raise E.GpuQueryError(f"the GPU check did not finish within {s.gate.deadline:g} s",
                              "NVML hung? see `nvidia-smi`, `dmesg | grep -i xid`; raise gate.deadline if the node is just slow")
    if "error" in ans:
        raise E.PvegpuError.from_json(ans["error"])
    if "crash" in ans:
        raise E.PvegpuError(f"internal error: {ans['crash']}", "please report it; the start is refused meanwhile (fail closed)")
    return dict(ans["ok"])


def bounded_verdict(vmid: int, s: Settings) -> dict[str, Any]:
    """The check under ``gate.deadline`` in a forked child, with settings already read (post-stop)."""
    return collect(_fork(lambda: _verdict(vmid, s)), s)


def check(vmid_text: str, opts: wiring.GlobalOptions, *, json_out: bool, wide: bool, out: TextIO, err: TextIO) -> int:
    """``pvegpu check VMID [--json] [--wide]`` (its line parsed by typer): the hook's pre-start check, said to a
    person (80 columns, or one line with ``wide``) or as a ``pvegpu-check`` document."""
    vmid: int | None = None
    try:
        vmid = check_vmid(vmid_text)
        child = start_check(vmid, opts)
        try:
            s = wiring.settings(opts)
        except E.PvegpuError:
            child.cancel()
            raise
        v = collect(child, s)
    except E.PvegpuError as exc:
        if json_out:  # the JSON consumer gets JSON (a check that says allow: false); the person watching still gets the message
            print(dumps(check_error_document(exc, vmid)), file=out)
        return exc.show(err)
    note = None
    if not v["allow"] and pending(s.gate.override_dir, vmid, s.gate.override_ttl):  # what the hook will do differs: say so
        note = f"pvegpu: note: an allow-once token is waiting: the next start of CT {vmid} passes the gate once anyway"
        v["json"]["allow_once_pending"] = True
    if json_out:
        print(dumps(document("check", {**v["json"], "error": None})), file=out)
    else:
        doc = v["json"]  # a running CT: its account on one line, not the pre-start's refusal
        line = "pvegpu: " + "; ".join(doc["reasons"] + [f"fix: {f}" for f in doc["fix"]]) + "." if doc.get("running") else v["text"]
        print("\n".join([line] + [note] * bool(note)) if wide else decision_text(v, vmid, note), file=out)
    if v["json"].get("running"):  # a running CT: an account, not a refusal; a GPU it cannot read is unknown, never zero
        return E.EXIT_GPU_UNKNOWN if any(g.get("state") == "unknown" for g in v["json"].get("gpus", ())) else E.EXIT_OK
    return E.EXIT_OK if v["allow"] else E.EXIT_REFUSED


def decision_text(v: dict[str, Any], vmid: int, note: str | None = None) -> str:
    """The check's decision in 80 columns: a head line, then each reason and each fix as an item of its own."""
    doc = v["json"]
    kind = "VM" if v.get("kind") == "qemu" else "CT"
    reasons, fixes = [str(r) for r in doc.get("reasons", [])], [str(f) for f in doc.get("fix", [])]
    text = str(v["text"])
    if doc.get("running") and reasons:  # no start to decide: the account of what it holds, headed by that
        head, reasons = f"pvegpu: {reasons[0]}", reasons[1:]
    elif v["allow"]:
        head = (text.split("; ")[0] if reasons else text).rstrip(".")
        reasons = reasons[1:] if reasons and reasons[0] in head else reasons
    else:
        head = f"pvegpu: refusing to start {kind} {vmid}:"
    lines = fit(head, "", "  ")
    for r in reasons:
        lines += fit(r, "  - ", "    ")
    for f in fixes:
        lines += fit(f, "  fix: ", "       ")
    if note:
        lines += fit(note, "", "  ")
    return "\n".join(lines)


def hook_command(args: list[str], out: TextIO, err: TextIO) -> int:
    """``pvegpu hook VMID PHASE``: what PVE sees. Only ``pre-start`` can refuse (fail closed)."""
    opts = wiring.GlobalOptions()  # PVE passes no options: PVEGPU_CONFIG and the PVEGPU_* variables say the rest
    try:
        if len(args) != 2:
            raise E.UsageError("usage: pvegpu hook VMID PHASE", HOOK_HINT)
        if args[1] not in PHASES:
            raise E.UsageError(f"unknown hook phase '{args[1]}'", f"PVE calls hookscripts with one of: {', '.join(PHASES)}")
        vmid = check_vmid(args[0])
    except E.PvegpuError as exc:
        return exc.show(err, prefix="pvegpu: ")
    if args[1] not in ("pre-start", "post-stop"):
        return E.EXIT_OK
    out.flush()
    err.flush()
    try:
        child = start_check(vmid, opts) if args[1] == "pre-start" else None  # the check runs from now on
    except E.PvegpuError as exc:  # no process for the check: refused, with the gate's code
        print(f"pvegpu: refusing to start CT {vmid}: {exc.inline('fix')}", file=err)
        return E.EXIT_REFUSED
    try:
        s = wiring.settings(opts)
    except E.PvegpuError as exc:  # broken settings: pre-start fails closed with the gate's code, post-stop never fails a stop
        if child is not None:
            child.cancel()
            print(f"pvegpu: refusing to start CT {vmid}: {exc.inline('fix')}", file=err)
            return E.EXIT_REFUSED
        print(f"pvegpu: post-stop check of CT {vmid} not done: {exc.inline('fix')}", file=err)
        return E.EXIT_OK
    if child is None:
        return _post_stop(vmid, s, out, err)
    return _pre_start(vmid, s, child, out, err)


def _pre_start(vmid: int, s: Settings, child: Child, out: TextIO, err: TextIO) -> int:
    own = wiring.own_start(s, vmid)
    if own:  # the reset's lock would refuse any other start; this one is the reset's own restart
        print(f"pvegpu: this start of CT {vmid} is the restart of pvegpu reset ({own}): its lock lets it through; "
              "the GPU is judged as for any start", file=out)
    dropped: list[str] = []
    override = take(s.gate.override_dir, vmid, s.gate.override_ttl, dropped)
    for why in dropped:  # a token that was there but is not honoured is never dropped without a word
        print(f"pvegpu: an allow-once token for CT {vmid} was not used and was removed: {why}", file=out)
    try:
        v = collect(child, s)
        allow, text = bool(v["allow"]), str(v["text"])
        kind = "VM" if v.get("kind") == "qemu" else "CT"
    except E.PvegpuError as exc:
        kind = "CT"
        allow, text = False, f"pvegpu: refusing to start CT {vmid}: {exc.inline('hint')}"
    if override:
        why = "" if allow else text.removeprefix(f"pvegpu: refusing to start {kind} {vmid}: ")
        print(f"pvegpu: {kind} {vmid} allowed to start ONCE by an override ({override})" + (f"; it would have refused: {why}" if why else ""), file=out)
        return E.EXIT_OK
    print(text, file=out if allow else err)
    if not allow:
        _tell_system_log(vmid, kind, s, text.removeprefix(f"pvegpu: refusing to start {kind} {vmid}: "), child.left(s.gate.deadline))
    return E.EXIT_OK if allow else E.EXIT_REFUSED


def _tell_system_log(vmid: int, kind: str, s: Settings, reason: str, left: float) -> None:
    """A refused start of an HA-managed guest also goes to the system log, with the guest and the reason: the task the
    admin started (``hastart``) ends OK and shows nothing; this refusal is only in HA's own start task. A guest whose
    HA state cannot be read (within ``left``, what remains of the hook's one ``gate.deadline``) is logged too (never
    guessed unmanaged)."""
    sid = f"{'vm' if kind == 'VM' else 'ct'}:{vmid}"
    try:  # in a child: /etc/pve is pmxcfs, whose read can hang, and PVE runs the hook with no timeout of its own
        done, ans = _fork(lambda: managed(sid, wiring.ha_files(s))).result(left, reap=False)
    except E.PvegpuError:
        done, ans = False, None
    ha = ans.get("ok") if done and ans else None
    if ha is False:
        return
    what = "HA-managed" if ha else "possibly HA-managed (HA state unknown)"
    wiring.system_log(s)(f"start gate refused the start of {what} {kind} {vmid} ({sid}): {reason}; HA retries it, may relocate "
                         f"it, then leaves it in 'error' (`ha-manager status`; `pvegpu hook status` names the settings to use)")


def _post_stop(vmid: int, s: Settings, out: TextIO, err: TextIO) -> int:
    """Never fails the stop: reports leftovers; with gate.post_stop_reclaim, stops the CT's stray holders."""
    try:
        guest = wiring.gate_pve(s).where(vmid)
    except E.PvegpuError:
        guest = None
    if guest is not None and guest.type == "qemu":  # a stopped VM's GPU stays on vfio-pci: nothing to check or report
        return E.EXIT_OK
    try:
        v = bounded_verdict(vmid, s)
    except E.PvegpuError as exc:
        print(f"pvegpu: post-stop check of CT {vmid}: {exc.message}", file=err)
        return E.EXIT_OK
    if v["allow"]:
        print(f"pvegpu: CT {vmid} stopped; its GPUs are clean.", file=out)
        return E.EXIT_OK
    msg = f"pvegpu: CT {vmid} stopped, GPUs NOT clean: " + "; ".join(v["json"]["reasons"])
    if s.gate.post_stop_reclaim:
        msg += f"; post-stop reclaim: {_reclaim(vmid, s)}"
    print(msg, file=out)
    return E.EXIT_OK


def _reclaim(vmid: int, s: Settings) -> str:
    from pvegpu.reset import reset  # post-stop only: pre-start, on every guest start, never resets

    try:
        with wiring.ct_lock(s, vmid, wait=0), wiring.world(s).reset_ports() as ports:
            outcome = reset(vmid, ports, wiring.post_stop_policy(s)).outcome
            return str(getattr(outcome, "value", outcome))
    except E.PvegpuError as exc:
        return f"not done: {exc.message}"


def main(args: list[str]) -> int:
    """``pvegpu hook VMID PHASE``, from ``__main__``: ``args`` are the words after ``hook``."""
    return hook_command(args, sys.stdout, sys.stderr)
