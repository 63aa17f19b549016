"""A VM's API calls through proxmoxer: config, status, power actions and the QEMU guest agent's exec.

``POST /nodes/{node}/qemu/{vmid}/agent/exec`` takes ``command`` as an array (one argv, never a shell string)
and answers the guest pid; ``GET .../agent/exec-status?pid=N`` answers ``exited``, ``exitcode`` and the
output, already base64-decoded by PVE. Each answer is checked at this edge (adapters/answers.py): an exec-status
without a readable ``exited`` (a body that is not JSON, a proxy's own JSON) and a status about another VM are API
errors (exit 4), never "still running" or "not running". Privileges for an API token: ``VM.GuestAgent.Unrestricted`` (PVE 9) or
``VM.Monitor`` (PVE 8) for exec, ``VM.PowerMgmt`` for shutdown/stop/start, ``VM.Audit`` to read.
Errors become PveApiError naming the call (through ``ProxmoxerPve._call``); an agent that is not running or
does not answer becomes AgentUnavailable, a 403 AgentForbidden.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pvegpu.adapters import answers
from pvegpu.adapters.pve import ProxmoxerPve
from pvegpu.core.errors import PveApiError
from pvegpu.core.model import Guest, TaskResult
from pvegpu.vm.guest import AgentForbidden, AgentUnavailable

# The agent is configured but does not answer. Not "VM N not running" (the VM itself is stopped: the core
# re-reads the VM's status and leaves a VM it did not stop alone), not a 403 (AgentForbidden).
_NO_AGENT = ("guest agent is not running", "qmp command 'guest-ping' failed", "got timeout",
             "QEMU guest agent is not", "No QEMU guest agent configured", "agent is not running")


class ProxmoxerVm:
    """The VmApi of ``pvegpu/vm/guest.py`` over a ProxmoxerPve (https with a token, or pvesh on the node)."""

    def __init__(self, pve: ProxmoxerPve) -> None:
        self.pve = pve

    def _vm(self, guest: Guest) -> Any:
        return self.pve.api.nodes(guest.node).qemu(guest.vmid)

    def where(self, vmid: int) -> Guest | None:
        return self.pve.where(vmid)

    def vm_config(self, guest: Guest) -> Mapping[str, Any]:
        """``pvesh get /nodes/<node>/qemu/<vmid>/config --current 1``."""
        return self.pve._call(f"read VM {guest.vmid} config", lambda: self._vm(guest).config.get(current=1), answers.vm_config)

    def vm_status(self, guest: Guest) -> Mapping[str, Any]:
        """``pvesh get /nodes/<node>/qemu/<vmid>/status/current``."""
        return self.pve._call(f"read VM {guest.vmid} status", lambda: self._vm(guest).status.current.get(),
                              lambda a: answers.vm_status(a, guest.vmid))

    def _agent(self, guest: Guest, what: str, fn: Any, check: Any) -> Any:
        try:
            return self.pve._call(f"{what} in VM {guest.vmid}", fn, check)
        except AgentUnavailable:
            raise
        except PveApiError as exc:
            if isinstance(exc.__cause__, answers.BadAnswer):  # its text quotes the answer: never matched as the agent's words
                raise
            if getattr(exc.__cause__, "status_code", None) == 403 or "permission denied" in exc.message.lower() \
                    or "permission check failed" in exc.message.lower():
                raise AgentForbidden(f"the API token may not use the guest agent of VM {guest.vmid} ({exc.message})",
                                     f"grant it VM.GuestAgent.Unrestricted (PVE 9) or VM.Monitor (PVE 8) on /vms/{guest.vmid}: "
                                     f"`pveum acl modify /vms/{guest.vmid} --tokens USER@REALM!TOKEN --roles ROLE`") from exc
            if any(s in exc.message for s in _NO_AGENT) and "No such file" not in exc.message:
                raise AgentUnavailable(f"the guest agent of VM {guest.vmid} does not answer ({exc.message})",
                                       f"is qemu-guest-agent running in the guest? `qm agent {guest.vmid} ping`; "
                                       f"`qm set {guest.vmid} --agent enabled=1` needs a VM restart") from exc
            raise

    def agent_ping(self, guest: Guest) -> None:
        """``qm agent <vmid> ping``."""
        self._agent(guest, "agent ping", lambda: self._vm(guest).agent.ping.post(), None)

    def agent_exec(self, guest: Guest, argv: list[str]) -> int:
        """``qm guest exec <vmid> -- argv...`` without waiting: the guest pid."""
        answer = self._agent(guest, f"run {argv[0]}", lambda: self._vm(guest).agent.exec.post(command=list(argv)), answers.obj)
        pid = answers.integer(answer, "pid", "the exec answer")
        assert pid is not None
        return pid

    def agent_exec_status(self, guest: Guest, pid: int) -> Mapping[str, Any]:
        """``pvesh get /nodes/<node>/qemu/<vmid>/agent/exec-status --pid N``: checked (``answers.exec_status``)."""
        return self._agent(guest, "read exec status", lambda: self._vm(guest).agent("exec-status").get(pid=pid), answers.exec_status)

    def vm_shutdown(self, guest: Guest, timeout: int) -> str:
        """``qm shutdown <vmid> --timeout T``: the task's UPID."""
        return self.pve._call(f"shut VM {guest.vmid} down", lambda: self._vm(guest).status.shutdown.post(timeout=int(timeout)), answers.upid)

    def vm_stop(self, guest: Guest) -> str:
        """``qm stop <vmid>``: the task's UPID."""
        return self.pve._call(f"stop VM {guest.vmid}", lambda: self._vm(guest).status.stop.post(), answers.upid)

    def vm_start(self, guest: Guest) -> str:
        """``qm start <vmid>``: the task's UPID."""
        return self.pve._call(f"start VM {guest.vmid}", lambda: self._vm(guest).status.start.post(), answers.upid)

    def wait_task(self, node: str, upid: str, *, timeout: float, what: str) -> TaskResult:
        return self.pve.wait_task(node, upid, timeout=timeout, what=what)
