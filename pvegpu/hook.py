"""``pvegpu check VMID`` and ``pvegpu hook VMID PHASE``: the start gate's commands, on the light path.

PVE runs a guest's hookscript as ``<script> <vmid> <phase>`` with ``PATH=/sbin:/bin:/usr/sbin:/usr/bin``,
``LC_ALL=C``, stdin ``/dev/null``, no timeout, while it holds the container's config lock; a non-zero
``pre-start`` aborts the start. So this module imports no typer, rich, proxmoxer or structlog, never calls
the API or ``pct``, and bounds the check with ``gate.deadline`` (it runs in a forked child). ``check`` and
the hook's ``pre-start`` are one code path: the same parse rules, the same bounded check, the same decision.
"""

from __future__ import annotations

import sys

from . import errors as E
from . import wiring
from .locate import check_vmid

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:  # the check itself (gate, holders, adapters) is imported in its forked child, beside NVML's start
    from typing import Any, TextIO

    from .adapters.child import Child
    from .adapters.nvml_warm import NvmlWarmup
    from .settings import Settings

PHASES = ("pre-start", "post-start", "pre-stop", "post-stop")

CHECK_USAGE = """Usage: pvegpu [--config FILE] check VMID [--json] [--wide]

  May container VMID start now? The start gate's decision, exactly as the hookscript makes it.
  Exit 0: yes, or it runs (no start to decide: what it holds is printed);
  10: refused (the reason and the fix are printed); 2, 3, 5: see README.

Options:
  --json        print the decision as JSON (errors too)
  --wide, -v    the decision as one line, as the task log shows it (default: 80 columns)
  --config FILE settings file (default /etc/pvegpu/pvegpu.toml, or PVEGPU_CONFIG)
  -h, --help    show this message"""

HOOK_USAGE = """Usage: pvegpu [--config FILE] hook VMID PHASE

  The hookscript entry, as PVE calls it (`pvegpu-guard VMID PHASE`). PHASE is one of
  pre-start, post-start, pre-stop, post-stop. pre-start refuses a start (exit 10, reason on stderr,
  so it lands in the task log) while the container's GPUs hold leftover memory; post-stop reports
  leftovers (and reclaims them with gate.post_stop_reclaim); the other phases exit 0 at once.

  Also: pvegpu hook install | uninstall | status | allow-once (see `pvegpu hook --help`)."""


def _verdict(vmid: int, s: Settings, warm: NvmlWarmup | None = None) -> dict[str, Any]:
    """The check as plain data, so it can cross the pipe from the bounded child."""
    from .gate import evaluate, paragraph

    ports = wiring.gate_ports(s, warm)
    guest = ports.pve.where(vmid)
    if guest is not None and guest.type == "qemu":  # a VM: pvegpu/vmgate.py (imported for VMs only)
        from .vmgate import vm_verdict

        vm = vm_verdict(vmid, ports, wiring.gate_policy(s), lambda: wiring.gate_files(s))
        if vm is not None:
            return vm
    res = evaluate(vmid, ports, wiring.gate_policy(s))
    return {"allow": res.decision.allow, "text": paragraph(vmid, res.decision), "json": res.to_json()}


def start_check(vmid: int, opts: wiring.GlobalOptions) -> Child:
    """The check, started now in a forked child, before this process reads its settings: the child starts NVML
    in a thread at once (``adapters/nvml_warm.py``), beside its own imports, settings, ``/etc/pve`` and ``/proc``
    reads; ``gate.deadline`` counts from this fork (``collect``). The same settings are read on both sides."""
    def check() -> dict[str, Any]:
        warm = wiring.warm_nvml(opts.simulate)
        return _verdict(vmid, wiring.settings(opts), warm)

    return _fork(check)


def _fork(fn: Any) -> Child:
    """``Child(fn)``; no process or pipe left for it (EAGAIN, EMFILE) is a PvegpuError: the gate fails closed."""
    from .adapters.child import Child

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


def check_command(args: list[str], opts: wiring.GlobalOptions, out: TextIO, err: TextIO) -> int:
    """``pvegpu check VMID [--json]``."""
    if any(a in ("-h", "--help") for a in args):
        print(CHECK_USAGE, file=out)
        return E.EXIT_OK
    json_out = "--json" in args
    wide = any(a in ("--wide", "-v", "--verbose") for a in args)
    vmid: int | None = None
    try:
        words = [a for a in args if a not in ("--json", "--wide", "-v", "--verbose")]
        if len(words) != 1 or words[0].startswith("-"):
            raise E.UsageError("usage: pvegpu check VMID [--json] [--wide]", "e.g. `pvegpu check 129`; `pvegpu check --help`")
        vmid = check_vmid(words[0])
        child = start_check(vmid, opts)
        try:
            s = wiring.settings(opts)
        except E.PvegpuError:
            child.cancel()
            raise
        v = collect(child, s)
    except E.PvegpuError as exc:
        if json_out:  # the JSON consumer gets JSON (a check that says allow: false); the person watching still gets the message
            import json

            from .contract import check_error_document

            print(json.dumps(check_error_document(exc, vmid), indent=2), file=out)
        return exc.show(err)
    from .adapters.override import pending

    note = None
    if not v["allow"] and pending(s.gate.override_dir, vmid, s.gate.override_ttl):  # what the hook will do differs: say so
        note = f"pvegpu: note: an allow-once token is waiting: the next start of CT {vmid} passes the gate once anyway"
        v["json"]["allow_once_pending"] = True
    if json_out:
        import json

        from .contract import document

        print(json.dumps(document("check", {**v["json"], "error": None}), indent=2), file=out)
    else:
        doc = v["json"]  # a running CT: its account on one line, not the pre-start's refusal
        line = "pvegpu: " + "; ".join(doc["reasons"] + [f"fix: {f}" for f in doc["fix"]]) + "." if doc.get("running") else v["text"]
        print("\n".join([line] + [note] * bool(note)) if wide else decision_text(v, vmid, note), file=out)
    return E.EXIT_OK if v["allow"] or v["json"].get("running") else E.EXIT_REFUSED  # a running CT: an account, not a refusal


def decision_text(v: dict[str, Any], vmid: int, note: str | None = None) -> str:
    """The check's decision in 80 columns: a head line, then each reason and each fix as an item of its own."""
    from .textfit import fit

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


def hook_command(args: list[str], opts: wiring.GlobalOptions, out: TextIO, err: TextIO) -> int:
    """``pvegpu hook VMID PHASE``: what PVE sees. Only ``pre-start`` can refuse (fail closed)."""
    if any(a in ("-h", "--help") for a in args):
        print(HOOK_USAGE, file=out)
        return E.EXIT_OK
    try:
        if len(args) != 2:
            raise E.UsageError("usage: pvegpu hook VMID PHASE", "PVE calls it as `<script> <vmid> <phase>`; `pvegpu hook --help`")
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
    from .adapters.override import take

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
    return E.EXIT_OK if allow else E.EXIT_REFUSED


def _post_stop(vmid: int, s: Settings, out: TextIO, err: TextIO) -> int:
    """Never fails the stop: reports leftovers; with gate.post_stop_reclaim, stops the CT's stray holders."""
    try:
        guest = wiring.gate_ports(s).pve.where(vmid)
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
    from .reset import reset

    try:
        with wiring.ct_lock(s, vmid, wait=0), wiring.world(s).reset_ports() as ports:
            outcome = reset(vmid, ports, wiring.post_stop_policy(s)).outcome
            return str(getattr(outcome, "value", outcome))
    except E.PvegpuError as exc:
        return f"not done: {exc.message}"


def main(args: list[str], opts: wiring.GlobalOptions) -> int:
    """Entry from the front door for ``check ...`` and ``hook VMID PHASE``."""
    if args[0] == "check":
        return check_command(args[1:], opts, sys.stdout, sys.stderr)
    return hook_command(args[1:], opts, sys.stdout, sys.stderr)
