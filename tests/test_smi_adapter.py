"""The nvidia-smi adapter of `pvegpu gpu-reset` on stand-in binaries (never the real one): a hard deadline, a child
stuck past SIGKILL abandoned and said; Fabric Manager from its process and from `systemctl is-active`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from pvegpu.adapters import smi as smi_mod
from pvegpu.adapters.pvesh import REAP_WAIT
from pvegpu.adapters.smi import SmiControl
from pvegpu.core.errors import GpuQueryError
from pvegpu.core.model import GpuInfo
from tests.test_fuse_scan import _daemons, _stop

GPU = GpuInfo(0, 0, "GPU-aaaa0000-0000", "0000:41:00.0")
DEADLINE = 0.5


def _binary(path, body: str):
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o700)
    return str(path)


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie (dead, not yet reaped by whoever inherited it)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_stand_in_that_ignores_sigterm_is_killed_at_the_deadline_and_reaped(tmp_path):
    """nvidia-smi that ignores SIGTERM and sleeps: a GpuQueryError (killed, not stuck) within the deadline plus the
    reap wait, and the child is gone, its own children too (the group is killed)."""
    pids = tmp_path / "pids"
    ctl = SmiControl(_binary(tmp_path / "nvidia-smi", f"trap '' TERM\nsleep 30 &\necho $$ $! > {pids}\nwait\n"), DEADLINE)
    t = time.monotonic()
    with pytest.raises(GpuQueryError) as exc:
        ctl.reset(GPU)
    assert time.monotonic() - t < DEADLINE + REAP_WAIT + 1
    assert "did not finish" in exc.value.message and "stuck" not in exc.value.message
    assert all(_gone(int(p)) for p in pids.read_text().split())


def test_the_tools_exit_status_and_words_make_the_error(tmp_path):
    """A stand-in that fails (exit 255, "In use by another client" on stderr): the error carries the status and words."""
    ctl = SmiControl(_binary(tmp_path / "nvidia-smi", 'echo "GPU 00000000:41:00.0: In use by another client" >&2\nexit 255\n'), 5)
    with pytest.raises(GpuQueryError, match="exit 255.*In use by another client"):
        ctl.reset(GPU)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")
def test_a_child_stuck_in_the_kernel_past_sigkill_is_abandoned_and_said(tmp_path):
    """nvidia-smi stuck in the kernel (a read on a FUSE mount whose server never answers: uninterruptible, as a driver
    call is): killed at the deadline, not waited for past the reap wait, reported as stuck in the driver."""
    [daemon] = _daemons(tmp_path, 1)
    try:
        ctl = SmiControl(_binary(tmp_path / "nvidia-smi", f"exec cat /proc/{daemon.pid}/root{tmp_path}/m0/x\n"), DEADLINE)
        t = time.monotonic()
        with pytest.raises(GpuQueryError) as exc:
            ctl.reset(GPU)
        assert time.monotonic() - t < DEADLINE + REAP_WAIT + 1
        assert "did not end after SIGKILL" in exc.value.message and "stuck in the driver" in exc.value.message
    finally:
        _stop([daemon])  # the server gone, the stuck read fails and the child ends


# -- Fabric Manager ----------------------------------------------------------------------------------------------


@pytest.fixture
def no_fabric_process():
    """The tests of the unit's answer need a machine where no nv-fabricmanager process runs."""
    if SmiControl("nvidia-smi", 1)._fabric_process() is not False:
        pytest.skip("an nv-fabricmanager process runs here (or /proc cannot be read)")


@pytest.mark.parametrize(("said", "status", "expected"), [
    ("active", 0, True), ("activating", 3, True), ("inactive", 3, False), ("failed", 3, False), ("maintenance", 3, None), ("", 1, None)])
def test_systemctl_is_active_decides_fabric_manager(tmp_path, no_fabric_process, said, status, expected):
    """`systemctl is-active nvidia-fabricmanager`: running states are True, inactive/failed (a unit that does not
    exist is "inactive") False, an answer not known is None (unknown, never "not running")."""
    args = tmp_path / "args"
    ctl = SmiControl("nvidia-smi", 1, systemctl=_binary(tmp_path / "systemctl", f'echo "$@" > {args}\necho "{said}"\nexit {status}\n'))
    assert ctl.fabric_manager() is expected
    assert args.read_text().split() == ["is-active", "nvidia-fabricmanager"]


def test_a_wedged_systemctl_is_unknown_within_its_deadline(tmp_path, no_fabric_process, monkeypatch):
    """systemctl that never answers: None (cannot tell) within its deadline, not False."""
    monkeypatch.setattr(smi_mod, "SYSTEMCTL_TIMEOUT", 0.3)
    ctl = SmiControl("nvidia-smi", 1, systemctl=_binary(tmp_path / "systemctl", "sleep 30\n"))
    t = time.monotonic()
    assert ctl.fabric_manager() is None
    assert time.monotonic() - t < 0.3 + REAP_WAIT + 1


def test_no_systemctl_and_no_process_is_not_running(tmp_path, no_fabric_process):
    """No systemctl on the node (no systemd to run the unit) and no nv-fabricmanager process: False."""
    assert SmiControl("nvidia-smi", 1, systemctl=str(tmp_path / "absent")).fabric_manager() is False


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: only root's nv-fabricmanager in the host's PID namespace counts")
def test_a_fabric_manager_process_is_running_whatever_systemd_says(tmp_path):
    """A process named nv-fabricmanager (started by hand by root, not by its unit): True, though systemctl says inactive."""
    exe = tmp_path / "nv-fabricmanager"
    exe.symlink_to(sys.executable)
    p = subprocess.Popen([str(exe), "-c", "print('ok', flush=True); import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ok"
        ctl = SmiControl("nvidia-smi", 1, systemctl=_binary(tmp_path / "systemctl", "echo inactive\nexit 3\n"))
        assert ctl.fabric_manager() is True
    finally:
        p.kill()
        p.wait(10)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_process_named_nv_fabricmanager_in_another_pid_namespace_does_not_count(tmp_path, no_fabric_process):
    """A tenant's process named nv-fabricmanager (its own PID namespace, as in a container): not Fabric Manager."""
    exe = tmp_path / "nv-fabricmanager"
    exe.symlink_to(sys.executable)
    p = subprocess.Popen(["unshare", "--pid", "--fork", str(exe), "-c", "print('ok', flush=True); import time; time.sleep(60)"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ok"
        ctl = SmiControl("nvidia-smi", 1, systemctl=str(tmp_path / "absent"))
        assert ctl.fabric_manager() is False
    finally:
        p.kill()
        p.wait(10)
