"""Looking inside a VM through the guest agent: the fixed commands, their bounded runs, and parsing what comes back.

Every command sent to the guest is a fixed argument vector: ``nvidia-smi`` with fixed options, or ``sh -c
SCRIPT`` where SCRIPT is a constant of this module and the only further arguments are a signal name from a fixed
set and integers pvegpu formatted itself. No text from the guest, the tenant or the config is ever put into a
command. What the guest prints is the tenant's claim: parsed strictly (fixed fields, digits only, bounded line
count), used only to decide about that guest itself, and escaped (``safetext``) before anyone sees it.

Manual equivalent: ``qm guest exec VMID -- nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``
and ``qm guest exec VMID -- sh -c 'find /proc/[0-9]*/fd -lname "/dev/nvidia[0-9]*"'``, ``qm guest exec VMID -- kill -TERM PID``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pvegpu.core import errors as E
from pvegpu.core.deadline import Deadline, deadline_in
from pvegpu.core.model import MIB, Guest, TaskResult, Via
from pvegpu.core.ports import Clock
from pvegpu.core.safetext import escape

MAX_LINES = 4096  # lines of guest output read per command (a tenant cannot make pvegpu parse more)
MAX_PIDS = 512  # holders signalled per round

NVSMI_APPS = ("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
NVSMI_GPUS = ("nvidia-smi", "--query-gpu=index,pci.bus_id,memory.used", "--format=csv,noheader,nounits")

# Every process with an fd on /dev/nvidiaN (N a digit: the GPUs, not nvidiactl/uvm), whether it maps the device
# (a CUDA context owner) and its start time (stat field 22, to never signal a recycled pid), then its name with
# every byte outside [A-Za-z0-9._+-] replaced, so a name cannot forge a line.
SCAN_SCRIPT = r"""
find / -maxdepth 0 -lname x >/dev/null 2>&1 || { echo "scan-unsupported: find has no -lname"; exit 3; }
start_of() { s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1; s=${s##*) }; set -- $s; shift 19 || return 1; echo "$1"; }
for p in $(find /proc/[0-9]*/fd -maxdepth 1 -lname '/dev/nvidia[0-9]*' 2>/dev/null | cut -d/ -f3 | sort -un); do
  st=$(start_of "$p") || continue
  via=fd
  grep -q ' /dev/nvidia[0-9]' "/proc/$p/maps" 2>/dev/null && via=fd,maps
  name=$(head -c 16 "/proc/$p/comm" 2>/dev/null | tr -d '\n' | tr -c 'A-Za-z0-9._+-' '_')
  echo "holder $p $st $via ${name:-?}"
done
echo scan-done
"""

# Signal each (pid, start time) pair only if that pid still has that start time; say what happened to each.
KILL_SCRIPT = r"""
start_of() { s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1; s=${s##*) }; set -- $s; shift 19 || return 1; echo "$1"; }
sig=$1; shift
while [ $# -ge 2 ]; do
  p=$1; want=$2; shift 2
  now=$(start_of "$p") || { echo "gone $p"; continue; }
  [ "$now" = "$want" ] || { echo "gone $p"; continue; }
  if kill -s "$sig" "$p" 2>/dev/null; then echo "sent $p"; else echo "failed $p"; fi
done
echo kill-done
"""
SIGNALS = ("TERM", "KILL")

_APP = re.compile(r"^\s*(\d{1,10})\s*,\s*(\d{1,15}|\[N/A\]|N/A|\[Not Supported\])\s*$")
_GPU = re.compile(r"^\s*(\d{1,4})\s*,\s*([0-9A-Fa-f:.]{7,20})\s*,\s*(\d{1,15}|\[N/A\]|N/A)\s*$")
_HOLDER = re.compile(r"^holder (\d{1,10}) (\d{1,20}) (fd|fd,maps) ([A-Za-z0-9._+\-?]{1,16})$")
_KILLED = re.compile(r"^(sent|gone|failed) (\d{1,10})$")


class AgentUnavailable(E.PveApiError):
    """The guest agent is not configured, not running, or does not answer (exit 4)."""


class AgentForbidden(E.PveApiError):
    """The API token lacks the privilege to run commands in the guest (a 403; exit 4): says nothing about the guest."""


class GuestTimeout(E.PveApiError):
    """A command in the guest did not finish within its deadline (exit 4)."""


class GuestOutputCut(E.PveApiError):
    """The agent cut a command's output at its limit (``out-truncated``/``err-truncated``), or a listing ran past the
    lines pvegpu reads: what holds the GPU is unknown (exit 4), never "clean", and no reason for a power action."""


class GuestCannotTell(E.GpuQueryError):
    """The guest cannot show its GPU use: Windows, no nvidia-smi on its PATH, nvidia-smi failing (exit 5)."""


class VmApi(Protocol):
    """The Proxmox calls a VM reset needs (``adapters/agent.py``). Answers come checked (``adapters/answers.py``):
    ``vm_status`` is about this VM, with ``status`` running or stopped; ``agent_exec_status`` always has ``exited``;
    an answer that is not so is a PveApiError, never a value."""

    def where(self, vmid: int) -> Guest | None: ...
    def vm_config(self, guest: Guest) -> Mapping[str, Any]: ...
    def vm_status(self, guest: Guest) -> Mapping[str, Any]: ...
    def agent_ping(self, guest: Guest) -> None: ...
    def agent_exec(self, guest: Guest, argv: list[str]) -> int: ...
    def agent_exec_status(self, guest: Guest, pid: int) -> Mapping[str, Any]: ...
    def vm_shutdown(self, guest: Guest, timeout: int) -> str: ...
    def vm_stop(self, guest: Guest) -> str: ...
    def vm_start(self, guest: Guest) -> str: ...
    def wait_task(self, node: str, upid: str, *, timeout: float, what: str) -> TaskResult: ...


@dataclass(frozen=True)
class ExecResult:
    exitcode: int | None
    out: str
    err: str
    signal: int | None = None


@dataclass(frozen=True)
class GuestHolder:
    """A guest process holding a GPU, as the guest tells it (guest pids; the name is sanitised and escaped)."""

    pid: int
    start: int | None  # stat field 22 in the guest; None when only nvidia-smi listed it
    via: frozenset[str]  # "nvml" (nvidia-smi lists it), "fd", "maps"
    comm: str = "?"
    used_mib: int | None = None

    @property
    def could_own_context(self) -> bool:
        return Via.NVML in self.via or Via.MAPS in self.via

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "comm": self.comm, "via": sorted(self.via), "used_mib": self.used_mib,
                "used_bytes": None if self.used_mib is None else self.used_mib * MIB}  # nvidia-smi counts whole MiB


@dataclass
class GuestView:
    """One look inside the guest: its GPUs' memory and who holds them."""

    holders: list[GuestHolder] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)  # index, bus_id (the guest's), used_mib
    listed_gone: list[int] = field(default_factory=list)  # nvidia-smi lists them, the guest has no such process
    begun_after: int = 0  # guest commands started before this look began (``Guestside.after_signals`` orders it against the signals)

    @property
    def killable(self) -> list[GuestHolder]:
        """Holders pvegpu may signal: they may own a context, never the guest's init (pid 1)."""
        return [h for h in self.holders if h.could_own_context and h.pid > 1][:MAX_PIDS]

    @property
    def clean(self) -> bool:
        return not [h for h in self.holders if h.could_own_context] and not self.listed_gone

    def to_json(self) -> dict[str, Any]:
        gpus = [g | {"used_bytes": None if g.get("used_mib") is None else int(g["used_mib"]) * MIB} for g in self.gpus]
        return {"holders": [h.to_json() for h in self.holders], "gpus": gpus, "listed_gone": self.listed_gone}


def _lines(text: str) -> list[str]:
    return text.splitlines()[:MAX_LINES]


def _overflows(text: str) -> bool:
    """More lines than pvegpu reads (``MAX_LINES``): what lies past them is unread, so the listing is incomplete."""
    return len(text.splitlines()) > MAX_LINES


def parse_apps(out: str) -> list[tuple[int, int | None]]:
    """``nvidia-smi --query-compute-apps=pid,used_memory`` lines → (pid, MiB or None); anything else is ignored."""
    rows = []
    for line in _lines(out):
        if m := _APP.match(line):
            rows.append((int(m.group(1)), int(m.group(2)) if m.group(2).isdigit() else None))
    return rows


def parse_gpus(out: str) -> list[dict[str, Any]]:
    rows = []
    for line in _lines(out):
        if m := _GPU.match(line):
            rows.append({"index": int(m.group(1)), "bus_id": m.group(2).lower(),
                         "used_mib": int(m.group(3)) if m.group(3).isdigit() else None})
    return rows


def parse_scan(out: str) -> tuple[dict[int, GuestHolder], bool]:
    """The fd scan's lines → holders by pid, and whether the scan ran to its end (``scan-done``)."""
    found: dict[int, GuestHolder] = {}
    lines = _lines(out)
    for line in lines:
        if m := _HOLDER.match(line):
            pid = int(m.group(1))
            found[pid] = GuestHolder(pid, int(m.group(2)), frozenset(m.group(3).split(",")), escape(m.group(4)))
    return found, "scan-done" in lines


class Guestside:
    """Runs the fixed commands in one VM through the API's guest agent, each under a deadline."""

    def __init__(self, api: VmApi, guest: Guest, clock: Clock, *, exec_timeout: float, poll: float = 0.1,
                 on_exec: Callable[[list[str]], None] | None = None) -> None:
        self.api, self.guest, self.clock = api, guest, clock
        self.exec_timeout, self.poll = exec_timeout, poll
        self.on_exec = on_exec
        self.commands = 0  # commands started in the guest so far: orders the looks against the signals
        self.signalled = 0  # the number of the last signal command (0: none yet)

    def run(self, argv: list[str], *, what: str, deadline: Deadline | None = None) -> ExecResult:
        """``agent/exec`` then ``agent/exec-status`` polled until it exits, at most ``exec_timeout`` and never past
        ``deadline`` (the phase's end); then GuestTimeout."""
        if self.on_exec:
            self.on_exec(argv)
        self.commands += 1
        pid = self.api.agent_exec(self.guest, argv)
        t0 = self.clock.monotonic()
        end = deadline.within(self.exec_timeout) if deadline is not None else deadline_in(self.clock, self.exec_timeout)
        while True:
            st = self.api.agent_exec_status(self.guest, pid)
            if _true(st.get("exited")):
                cut = [k for k in ("out-truncated", "err-truncated") if _true(st.get(k))]
                if cut:
                    raise self._cut(what, cut[0])
                code = st.get("exitcode")
                sig = st.get("signal")
                return ExecResult(code if isinstance(code, int) and not isinstance(code, bool) else None,
                                  str(st.get("out-data") or ""), str(st.get("err-data") or ""),
                                  sig if isinstance(sig, int) and not isinstance(sig, bool) else None)
            if end.expired():  # the command is left to the guest: its pid may be reused by the time a kill arrives
                raise GuestTimeout(f"{what} in VM {self.guest.vmid} did not finish within {max(0.0, end.at - t0):.3g} s",
                                   "the guest is overloaded or the command hangs (a stuck driver?); look with `qm guest exec "
                                   f"{self.guest.vmid} -- nvidia-smi`, or raise reset.timeout")
            end.pause(self.poll)

    def _cut(self, what: str, why: str) -> GuestOutputCut:
        vmid = self.guest.vmid
        return GuestOutputCut(f"the output of {what} in VM {vmid} is incomplete ({why}): who holds the GPU is unknown",
                              f"look by hand: `qm guest exec {vmid} -- nvidia-smi`; nothing was judged from the cut listing")

    def nvidia_smi(self, argv: tuple[str, ...], deadline: Deadline | None = None) -> str:
        try:
            r = self.run(list(argv), what="nvidia-smi", deadline=deadline)
        except GuestOutputCut:
            raise
        except E.PveApiError as exc:
            if "No such file" in exc.message or "not found" in exc.message.lower():
                raise GuestCannotTell(f"VM {self.guest.vmid} has no nvidia-smi on the guest agent's PATH",
                                      "install the NVIDIA driver's utilities in the guest (a Windows guest is not supported)") from None
            raise
        if r.exitcode != 0:
            why = escape((r.err or r.out).strip().splitlines()[0] if (r.err or r.out).strip() else f"exit code {r.exitcode}", 200)
            raise GuestCannotTell(f"nvidia-smi in VM {self.guest.vmid} failed: {why}",
                                  f"`qm guest exec {self.guest.vmid} -- nvidia-smi`: is the driver loaded in the guest?")
        return r.out

    def look(self, deadline: Deadline | None = None) -> GuestView:
        """nvidia-smi's apps and GPUs, plus the fd scan, merged by guest pid; every command ends by ``deadline``. A
        listing the agent cut, or longer than pvegpu reads, is GuestOutputCut: never judged."""
        begun_after = self.commands
        out = self.nvidia_smi(NVSMI_APPS, deadline)
        if _overflows(out):
            raise self._cut("nvidia-smi", f"more than {MAX_LINES} lines")
        apps = parse_apps(out)
        gpus = parse_gpus(self.nvidia_smi(NVSMI_GPUS, deadline))
        r = self.run(["sh", "-c", SCAN_SCRIPT, "pvegpu-scan"], what="the /proc fd scan", deadline=deadline)
        if _overflows(r.out):
            raise self._cut("the /proc fd scan", f"more than {MAX_LINES} lines")
        found, complete = parse_scan(r.out)
        if not complete:
            why = escape((r.out if "scan-unsupported" in r.out else r.err).strip()[:200]) or f"exit code {r.exitcode}"
            raise GuestCannotTell(f"the /proc fd scan in VM {self.guest.vmid} did not complete: {why}",
                                  "the guest needs sh, GNU find (-lname), cut, sort, grep, head and tr on the agent's PATH")
        view = GuestView(gpus=gpus, begun_after=begun_after)
        for pid, mib in apps:
            h = found.get(pid)
            if h is None:
                view.listed_gone.append(pid)  # listed by NVML, no fd on a GPU: dead, or a fork child holds its context
                continue
            found[pid] = GuestHolder(pid, h.start, h.via | {Via.NVML}, h.comm, mib)
        if view.listed_gone and any(h.could_own_context for h in found.values()):
            view.listed_gone = []  # a live holder that maps the device explains it (fork-inherited context)
        view.holders = sorted(found.values(), key=lambda h: h.pid)
        return view

    def signal(self, sig: str, holders: list[GuestHolder]) -> dict[int, str]:
        """SIGTERM or SIGKILL to each holder whose start time still matches; pid → sent / gone / failed."""
        assert sig in SIGNALS
        pairs: list[str] = []
        for h in holders:
            if h.pid > 1 and h.start is not None:
                pairs += [str(int(h.pid)), str(int(h.start))]
        if not pairs:
            return {}
        self.signalled = self.commands + 1  # this command's number: it may take effect even if its answer never comes
        r = self.run(["sh", "-c", KILL_SCRIPT, "pvegpu-kill", sig, *pairs], what=f"kill -{sig}")
        out: dict[int, str] = {}
        for line in _lines(r.out):
            if m := _KILLED.match(line):
                out[int(m.group(2))] = m.group(1)
        return out

    def after_signals(self, view: GuestView) -> bool:
        """Whether ``view``'s look began after the last signal was sent (always, when none was)."""
        return view.begun_after >= self.signalled


def _true(v: Any) -> bool:
    return v is True or v == 1 or v == "1"
