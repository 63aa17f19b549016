"""A "guest" for the VM reset tests: the real QEMU guest agent (Debian's qemu-guest-agent, ``qemu-ga``) in its own
PID and mount namespace, and a forwarder that makes fakepve's ``agent/*`` endpoints talk to it with PVE's mapping.

The namespace plays the VM: ``qemu-ga`` is its PID 1 (``-m unix-listen -p SOCK``), ``/dev`` is a private tmpfs in
which ``/dev/nvidia0`` is the host's ``/dev/zero`` (a character device processes can open and map), and the
agent's PATH starts with a directory holding a stand-in ``nvidia-smi``: a script that lists the guest processes
mapping ``/dev/nvidia0`` as compute apps (1024 MiB each), so what it prints follows real processes, dead pids
drop out as the kernel reaps them, and a test can make it hang or remove it.

PVE's mapping (qemu-server ``PVE::API2::Qemu::Agent``): ``command`` array → ``guest-exec`` ``path`` + ``arg`` with
``capture-output`` on; ``exec-status`` answers with ``out-data``/``err-data`` base64-decoded and booleans as 1/0.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Any

QEMU_GA = shutil.which("qemu-ga") or "/usr/sbin/qemu-ga"

NVIDIA_SMI = r"""#!/bin/sh
# stand-in nvidia-smi: the guest processes that map /dev/nvidia0 are its compute apps
[ -e "$(dirname "$0")/hang" ] && exec sleep 3600
case "$1" in
  --query-compute-apps=*)
    for m in /proc/[0-9]*/maps; do
      grep -q ' /dev/nvidia0' "$m" 2>/dev/null || continue
      p=${m#/proc/}; echo "${p%/maps}, 1024"
    done ;;
  --query-gpu=*)
    n=$(grep -l ' /dev/nvidia0' /proc/[0-9]*/maps 2>/dev/null | wc -l)
    echo "0, 00000000:01:00.0, $((n * 1024))" ;;
  *) echo "stand-in nvidia-smi"; ;;
esac
"""

SETUP = r"""
set -e
D=$1
mkdir -p "$D/hostdev"
mount --bind /dev "$D/hostdev"
mount -t tmpfs -o mode=755 guestdev /dev
for n in null zero full random urandom; do touch /dev/$n; mount --bind "$D/hostdev/$n" /dev/$n; done
touch /dev/nvidia0
mount --bind "$D/hostdev/zero" /dev/nvidia0
umount -l "$D/hostdev"
cd /
exec env -i PATH="$D/bin:/usr/sbin:/usr/bin:/sbin:/bin" "$2" -m unix-listen -p "$D/sock" -t "$D/state"
"""

SETUP_REAL = r"""
set -e
D=$1
cd /
exec env -i PATH="$D/bin:/usr/sbin:/usr/bin:/sbin:/bin" "$2" -m unix-listen -p "$D/sock" -t "$D/state"
"""

HOLDER = ("import mmap, os, signal, sys, time\n"
          "if 'ignore-term' in sys.argv: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "fd = os.open('/dev/nvidia0', os.O_RDONLY)\n"
          "m = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)\n"
          "time.sleep(3600)\n")


class QgaError(Exception):
    """qemu-ga answered an error, or could not be reached."""


class Guest:
    """The namespace "VM": start, talk to its agent, run holders in it, stop it (its whole process group)."""

    def __init__(self, root: str, real_gpu: bool = False) -> None:
        """``real_gpu``: the host's own /dev and nvidia-smi (the GPU machine), no stand-ins."""
        self.root = root
        self.sock = os.path.join(root, "sock")
        self.bin = os.path.join(root, "bin")
        os.makedirs(os.path.join(root, "state"), exist_ok=True)
        os.makedirs(self.bin, exist_ok=True)
        if not real_gpu:
            smi = os.path.join(self.bin, "nvidia-smi")
            with open(smi, "w") as f:
                f.write(NVIDIA_SMI)
            os.chmod(smi, 0o755)
        with open(os.path.join(root, "holder.py"), "w") as f:
            f.write(HOLDER)
        self.proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--propagation", "private",
                                      "sh", "-c", SETUP_REAL if real_gpu else SETUP, "guest-setup", root, QEMU_GA],
                                     stdout=subprocess.DEVNULL, stderr=open(os.path.join(root, "setup.log"), "w"),
                                     start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.qmp("guest-ping")
                return
            except QgaError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    log = open(os.path.join(root, "setup.log")).read()
                    raise RuntimeError(f"qemu-ga did not come up in the namespace: {log}") from None
                time.sleep(0.05)

    def qmp(self, execute: str, arguments: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
        """One QMP command over the agent's socket; its ``return`` or QgaError."""
        try:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(timeout)
            s.connect(self.sock)
            s.sendall(json.dumps({"execute": execute, **({"arguments": arguments} if arguments else {})}).encode() + b"\n")
            buf = b""
            while b"\n" not in buf:
                chunk = s.recv(1 << 20)
                if not chunk:
                    raise QgaError("the agent closed the connection")
                buf += chunk
            s.close()
        except OSError as exc:
            raise QgaError(f"agent unreachable: {exc}") from None
        answer = json.loads(buf.split(b"\n", 1)[0])
        if "error" in answer:
            raise QgaError(str(answer["error"].get("desc", answer["error"])))
        return answer.get("return")

    def spawn(self, *args: str) -> int:
        """A process in the guest, started by the agent (not captured): its guest pid."""
        return int(self.qmp("guest-exec", {"path": args[0], "arg": list(args[1:]), "capture-output": False})["pid"])

    def holder(self, *flags: str) -> int:
        """A process in the guest that opens and maps /dev/nvidia0 (the stand-in GPU)."""
        pid = self.spawn("python3", os.path.join(self.root, "holder.py"), *flags)
        self.wait_for(lambda: pid in self.mappers(), what=f"holder {pid} maps the device")
        return pid

    def respawner(self) -> None:
        """A supervisor (no GPU itself) that restarts a holder whenever it dies."""
        self.spawn("sh", "-c", f"while :; do python3 {self.root}/holder.py; sleep 0.05; done")
        self.wait_for(lambda: bool(self.mappers()), what="respawned holder maps the device")

    def mappers(self) -> list[int]:
        out = self.run("sh", "-c", "grep -l ' /dev/nvidia0' /proc/[0-9]*/maps 2>/dev/null | cut -d/ -f3")
        return sorted(int(x) for x in out.split())

    def run(self, *args: str, timeout: float = 10.0) -> str:
        pid = self.qmp("guest-exec", {"path": args[0], "arg": list(args[1:]), "capture-output": True})["pid"]
        deadline = time.monotonic() + timeout
        while True:
            st = self.qmp("guest-exec-status", {"pid": pid})
            if st.get("exited"):
                return base64.b64decode(st.get("out-data", "")).decode()
            if time.monotonic() > deadline:
                raise QgaError(f"{args} did not finish")
            time.sleep(0.02)

    def wait_for(self, cond: Any, what: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting: {what}")
            time.sleep(0.05)

    def stop_agent(self) -> None:
        """The agent dies: it is PID 1 of the namespace, so the whole "guest" goes with it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    stop = stop_agent


def forwarder(guest: Guest, vmid: int, original: Any) -> Any:
    """A replacement for ``fakepve.agent.result``: VM ``vmid``'s exec, exec-status and ping go to the real agent."""
    from fakepve.model import PveError

    def result(vm: Any, command: str, values: dict[str, Any]) -> Any:
        if vm.vmid != vmid or command not in ("exec", "exec-status", "ping"):
            return original(vm, command, values)
        try:
            if command == "ping":
                guest.qmp("guest-ping")
                return {"result": {}}
            if command == "exec":
                argv = values["command"]
                argv = [argv] if isinstance(argv, str) else list(argv)
                ret = guest.qmp("guest-exec", {"path": argv[0], "arg": argv[1:], "capture-output": True})
                return {"pid": ret["pid"]}
            ret = guest.qmp("guest-exec-status", {"pid": int(values["pid"])})
        except QgaError as exc:
            if "unreachable" in str(exc) or "closed" in str(exc):
                raise PveError(500, "QEMU guest agent is not running") from None
            raise PveError(500, f"Agent error: {exc}") from None
        out: dict[str, Any] = {"exited": 1 if ret.get("exited") else 0}
        for key in ("exitcode", "signal"):
            if key in ret:
                out[key] = ret[key]
        for key in ("out-data", "err-data"):
            if key in ret:
                out[key] = base64.b64decode(ret[key]).decode("utf-8", "replace")
        for key in ("out-truncated", "err-truncated"):
            if key in ret:
                out[key] = 1 if ret[key] else 0
        return out

    return result
