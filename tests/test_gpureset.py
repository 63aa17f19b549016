"""`pvegpu gpu-reset N` on the simulated node: the procedure end to end, every refusal, interruptions, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pvegpu.sim.state import SimState
from tests.pvelike import REPO
from tests.schemas import validate

SETTINGS = {"reset.timeout": 3, "gpureset.client_wait": 1}


def _scenario(gpu0: dict | None = None, **top: object) -> dict:
    return {"node": "s", "settings": SETTINGS,
            "gpus": [{"minor": 0, "index": 0, "uuid": "GPU-aaaa0000-0000", "recovery_action": "gpu-reset", "persistence_mode": True,
                      "leak_mib": 512} | (gpu0 or {}),
                     {"minor": 1, "index": 1, "uuid": "GPU-bbbb1111-1111", "recovery_action": "none"}],
            "containers": [
                {"vmid": 129, "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 256}]},
                {"vmid": 130, "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 128}]},
                {"vmid": 131, "status": "running", "gpus": [1], "workloads": [{"kind": "simple", "gpu": 1, "mib": 64}]},
                {"vmid": 132, "status": "stopped", "gpus": [0], "workloads": []}]} | top


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}


def _pvegpu(node, *args: str, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=_env(), stdin=stdin)


def _doc(r: subprocess.CompletedProcess[str]) -> dict:
    return validate(json.loads(r.stdout), "gpu-reset")


def _gpu(node, minor: int) -> dict:
    return next(g for g in SimState(node.root).gpus() if g["minor"] == minor)


def _init(node, vmid: int) -> int | None:
    return SimState(node.root).ct(vmid).get("init_pid")


def _holder(node, tmp_path, name: str = "dcgm-client") -> subprocess.Popen[str]:
    """A host process holding GPU 0's device node (an exporter, DCGM), named ``name``."""
    exe = tmp_path / name
    exe.symlink_to(sys.executable)
    p = subprocess.Popen([str(exe), "-c", "import os,sys,time; fd=os.open(sys.argv[1], os.O_RDONLY); print('ok', flush=True); "
                          "time.sleep(120)", _gpu(node, 0)["stand_in"]], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ok"
    return p


def test_gpu_reset_stops_the_cts_on_the_gpu_resets_verifies_and_starts_them_again(sim_node):
    """gpu-reset 0 --yes: CTs 129 and 130 stopped and started again (verified), CT 131 on GPU 1 untouched, the stopped
    CT 132 left stopped; the leak and the recovery action are gone, persistence mode is back on."""
    node = sim_node(_scenario())
    other, before = _init(node, 131), (_init(node, 129), _init(node, 130))
    r = _pvegpu(node, "gpu-reset", "0", "--yes", "--json")
    assert r.returncode == 0, r.stderr + r.stdout
    doc = _doc(r)
    assert doc["outcome"] == "reset" and doc["stopped"] == [129, 130] and doc["restarted"] == [129, 130] and not doc["left_stopped"]
    assert doc["recovery_action_after"] == "none" and doc["used_bytes_after"] <= 64 * 2**20
    assert _init(node, 131) == other and None not in (_init(node, 129), _init(node, 130))
    assert (_init(node, 129), _init(node, 130)) != before and SimState(node.root).ct(132)["status"] == "stopped"
    g = _gpu(node, 0)
    assert not g.get("leak_mib") and g["recovery_action"] == "none" and g["persistence_mode"] is True


def test_dry_run_stops_nothing_and_shows_the_plan(sim_node):
    """--dry-run: every guest granted GPU 0 is in the plan with its action; nothing is stopped or reset (exit 0)."""
    node = sim_node(_scenario())
    before = _init(node, 129)
    r = _pvegpu(node, "gpu-reset", "GPU-aaaa0000", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    doc = _doc(r)
    assert doc["outcome"] == "dry-run" and {g["vmid"] for g in doc["guests"]} == {129, 130, 132} and not doc["steps"]
    assert _init(node, 129) == before and _gpu(node, 0)["leak_mib"] == 512


def test_unknown_gpu_id_is_exit_2_listing_the_gpus(sim_node):
    """An id that names no GPU: exit 2, the GPUs that exist named, no traceback."""
    node = sim_node(_scenario())
    r = _pvegpu(node, "gpu-reset", "7")
    assert r.returncode == 2 and "GPU-bbbb1111-1111" in r.stderr and "Hint:" in r.stderr and "Traceback" not in r.stderr


def test_without_yes_and_without_a_terminal_it_refuses_with_exit_2(sim_node):
    """No --yes and stdin not a terminal: exit 2 with the hint, nothing stopped, the drain mark gone again."""
    node = sim_node(_scenario({"recovery_action": "none", "leak_mib": 0}, containers=[]))
    r = _pvegpu(node, "gpu-reset", "0")
    assert r.returncode == 2 and "--yes" in r.stderr and _gpu(node, 0)["persistence_mode"] is True


def test_a_gpu_with_nothing_on_it_is_reset_with_yes(sim_node):
    """A GPU no guest is granted and no process uses is reset with --yes (by PCI bus id)."""
    node = sim_node(_scenario(containers=[]))
    r = _pvegpu(node, "gpu-reset", "0000:41:00.0", "--yes", "--json")
    assert r.returncode == 0, r.stderr
    assert _doc(r)["outcome"] == "reset" and not _gpu(node, 0).get("leak_mib")


@pytest.mark.parametrize(("gpu0", "top", "kind"), [
    ({"nvlink_active": 4}, {}, "nvlink"),
    ({}, {"fabric_manager": True}, "fabric-manager"),
    ({"recovery_action": "node-reboot"}, {}, "reboot"),
    ({}, {"vms": [{"vmid": 200, "config": "name: w\nhostpci0: 0000:41:00.0,pcie=1\n"}], "pci": {"0000:41:00.0": "vfio-pci"}},
     "vm-passthrough"),
])
def test_refusals_known_from_the_plan_stop_nothing(sim_node, gpu0, top, kind):
    """NVLink peers, Fabric Manager, a GPU that needs a reboot, a VM passing it through: exit 11 naming the kind, no CT stopped."""
    node = sim_node(_scenario(gpu0, **top))
    before = _init(node, 129)
    r = _pvegpu(node, "gpu-reset", "0", "--yes", "--json")
    assert r.returncode == 11, r.stderr
    doc = _doc(r)
    assert doc["outcome"] == "refused" and kind in [x["kind"] for x in doc["refusals"]] and _init(node, 129) == before


def test_a_host_client_is_refused_with_its_pid_before_any_stop(sim_node, tmp_path):
    """A host process holding the GPU (DCGM, an exporter): exit 11 naming its pid; no CT stopped."""
    node = sim_node(_scenario())
    p = _holder(node, tmp_path)
    try:
        r = _pvegpu(node, "gpu-reset", "0", "--yes", "--json")
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 11
    doc = _doc(r)
    assert [x["kind"] for x in doc["refusals"]] == ["client"] and str(p.pid) in doc["refusals"][0]["problem"] and not doc["stopped"]


def test_a_persistenced_that_will_not_let_go_is_refused_and_the_cts_start_again(sim_node, tmp_path):
    """nvidia-persistenced is expected to let go once persistence is off; one that does not is refused after the wait,
    and the stopped CTs are started again (exit 11)."""
    node = sim_node(_scenario({"leak_mib": 0}))
    p = _holder(node, tmp_path, "nvidia-persistenced")
    try:
        r = _pvegpu(node, "gpu-reset", "0", "--yes", "--json")
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 11, r.stderr
    doc = _doc(r)
    assert str(p.pid) in doc["refusals"][0]["problem"] and doc["restarted"] == [129, 130] and not doc["reset_ran"]
    assert _gpu(node, 0)["persistence_mode"] is True


def test_a_gpu_the_driver_cannot_reset_is_refused_and_the_cts_start_again(sim_node):
    """nvidia-smi -r says "not supported": exit 11 (no-reset), the CTs run again."""
    node = sim_node(_scenario({"reset_supported": False, "leak_mib": 0}))
    r = _pvegpu(node, "gpu-reset", "0", "--yes", "--json")
    assert r.returncode == 11
    doc = _doc(r)
    assert [x["kind"] for x in doc["refusals"]] == ["no-reset"] and doc["restarted"] == [129, 130]


def test_a_start_onto_a_draining_gpu_is_refused_by_the_gate(sim_node):
    """While gpu-reset holds GPU 0 drained, `check` of a CT on it refuses (exit 10) naming gpu-reset; a dead holder's mark does not."""
    from pvegpu.adapters.drain import gpu_lock

    node = sim_node(_scenario({"leak_mib": 0, "recovery_action": "none"}, containers=[{"vmid": 132, "status": "stopped", "gpus": [0], "workloads": []}]))
    with gpu_lock(os.path.join(node.root, "drain"), 0, "GPU 0") as lock:  # a simulated node's gpureset.drain_dir
        lock.drain()
        r = _pvegpu(node, "check", "132")
        assert r.returncode == 10 and "gpu-reset" in r.stdout + r.stderr
    assert _pvegpu(node, "check", "132").returncode == 0


def _wait_stopped(node, vmid: int, proc: subprocess.Popen[str]) -> None:
    end = time.monotonic() + 30
    while SimState(node.root).ct(vmid).get("status") != "stopped":
        assert time.monotonic() < end and proc.poll() is None, "the CT was never stopped"
        time.sleep(0.02)


def _spawn(node, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pvegpu", "--simulate", node.root, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(), stdin=subprocess.DEVNULL)


def test_sigterm_after_a_stop_finishes_the_reset_and_starts_the_cts(sim_node):
    """SIGTERM once the CTs are stopped: the reset and the restart are finished, exit 143, the report says so."""
    node = sim_node(_scenario({"reset_hang": 2}))
    p = _spawn(node, "gpu-reset", "0", "--yes", "--json")
    _wait_stopped(node, 130, p)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    doc = validate(json.loads(out), "gpu-reset")
    assert doc["interrupted"]["signal"] == "SIGTERM" and doc["restarted"] == [129, 130] and not doc["left_stopped"]


def test_a_second_signal_abandons_and_names_the_stopped_cts(sim_node):
    """Two SIGTERMs after the stop: abandoned where it was, exit 143; the report names each CT left stopped."""
    node = sim_node(_scenario({"reset_hang": 5}))
    p = _spawn(node, "gpu-reset", "0", "--yes", "--json")
    _wait_stopped(node, 130, p)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    doc = validate(json.loads(out), "gpu-reset")
    assert sorted(doc["left_stopped"]) == [129, 130] and "pct start 129" in json.dumps(doc["diagnosis"])


def test_pvegpu_reset_of_a_ct_on_a_draining_gpu_is_busy(sim_node):
    """While a gpu-reset drains GPU 0, `pvegpu reset` of a CT on it is exit 9 naming the gpu-reset; nothing is signalled."""
    from pvegpu.adapters.drain import gpu_lock

    node = sim_node(_scenario())
    before = _init(node, 129)
    with gpu_lock(os.path.join(node.root, "drain"), 0, "GPU 0") as lock:
        lock.drain()
        r = _pvegpu(node, "reset", "129")
    assert r.returncode == 9 and "gpu-reset" in r.stderr and _init(node, 129) == before


def test_the_nvidia_smi_adapter_passes_the_uuid_bounds_each_call_and_carries_the_tools_words(tmp_path):
    """SmiControl (on a stand-in binary, never the real one): `-r -i UUID` and `-i UUID -pm 0`; a failure carries its
    output; a call past its deadline is a GpuQueryError, not a hang."""
    from pvegpu.adapters.smi import SmiControl
    from pvegpu.core.errors import GpuQueryError
    from pvegpu.core.model import GpuInfo

    log, smi = tmp_path / "args", tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$@" >> {log}\ncase "$*" in *GPU-bad*) echo "In use by another client" >&2; exit 255;; '
                   '*GPU-slow*) sleep 5;; esac\n')
    smi.chmod(0o700)
    ctl = SmiControl(str(smi), 0.5)
    ctl.reset(GpuInfo(0, 0, "GPU-ok", "0000:41:00.0"))
    ctl.persistence(GpuInfo(0, 0, "GPU-ok", "0000:41:00.0"), False)
    assert log.read_text().splitlines() == ["-r -i GPU-ok", "-i GPU-ok -pm 0"]
    with pytest.raises(GpuQueryError, match="In use by another client"):
        ctl.reset(GpuInfo(0, 0, "GPU-bad", "0000:41:00.0"))
    t = time.monotonic()
    with pytest.raises(GpuQueryError, match="did not finish"):
        ctl.reset(GpuInfo(0, 0, "GPU-slow", "0000:41:00.0"))
    assert time.monotonic() - t < 4


def test_a_start_refused_for_a_logged_xid_79_goes_through_after_gpu_reset(sim_node):
    """Xid 79 in the kernel log refuses a start onto GPU 0; gpu-reset 0 records its verified reset and the start goes through."""
    node = sim_node(_scenario({"recovery_action": "none", "leak_mib": 0, "xids": [{"code": 79, "at": 120}]}))
    assert _pvegpu(node, "check", "132").returncode == 10
    r = _pvegpu(node, "gpu-reset", "0", "--yes", "--json")
    assert r.returncode == 0, r.stderr + r.stdout
    assert any(s["name"] == "record" and s["outcome"] == "ok" for s in _doc(r)["steps"])
    assert _pvegpu(node, "check", "132").returncode == 0


def test_a_number_that_is_one_gpus_index_and_anothers_minor_is_refused_as_ambiguous():
    """`gpu-reset 1` where GPU index 1 is /dev/nvidia0 and /dev/nvidia1 is index 0: a usage error, never a guess."""
    from pvegpu.core.errors import UsageError
    from pvegpu.core.model import GpuInfo
    from pvegpu.gpureset import resolve

    gpus = [GpuInfo(0, 1, "GPU-aaaa0000-0000", "00000000:41:00.0"), GpuInfo(1, 0, "GPU-bbbb1111-1111", "00000000:81:00.0")]
    with pytest.raises(UsageError):
        resolve("1", gpus)
    same = [GpuInfo(0, 0, "GPU-aaaa0000-0000", "00000000:41:00.0"), GpuInfo(1, 3, "GPU-bbbb1111-1111", "00000000:81:00.0")]
    assert resolve("3", same).index == 1 and resolve("0", same).index == 0 and resolve("1", same).minor == 3


def test_dry_run_plan_fits_80_columns_with_a_full_uuid(sim_node):
    """`gpu-reset 0 --dry-run` with a real-length UUID: every line of the plan and its verdict fits 80 columns."""
    uuid = "GPU-8f2c1a3e-5b7d-4c9e-a1f0-123456789abc"
    node = sim_node(_scenario({"uuid": uuid}))
    r = _pvegpu(node, "gpu-reset", "0", "--dry-run")
    assert r.returncode == 0 and uuid in r.stdout, r.stderr
    assert max(len(line) for line in r.stdout.splitlines()) <= 80


def test_a_drain_mark_that_cannot_be_read_is_unknown_and_counts_as_a_mark(tmp_path, monkeypatch):
    """gpu<N>.lock exists but opening it fails (EIO): draining() names it unknown (the gate fails closed); no file, or a
    drain_dir gpu-reset itself would refuse (a file), is no mark for one GPU or for all."""
    import errno as _errno

    from pvegpu.adapters import drain

    d = str(tmp_path / "drain")
    with drain.gpu_lock(d, 0, "GPU 0"):
        pass
    assert drain.draining(d, 0) is None and drain.draining(d, 1) is None
    real_open = os.open

    def failing_open(path, *a, **kw):
        if path == "gpu0.lock":
            raise OSError(_errno.EIO, "Input/output error")
        return real_open(path, *a, **kw)

    monkeypatch.setattr(drain.os, "open", failing_open)
    assert drain.draining(d, 0) is not None and drain.draining(d, 1) is None
    assert drain.draining_any(d, frozenset({0, 1})) is not None
    monkeypatch.undo()
    afile = tmp_path / "not-a-dir"
    afile.write_text("")
    assert drain.draining_any(str(afile), None) is None and drain.draining(str(afile), 0) is None  # as gpu-reset judges it


def test_a_start_as_before_that_fails_before_its_hookscript_leaves_no_allow_once_token(sim_node):
    """The GPU was not reset (no-reset) and needs one: CT 129's start as before gets an allow-once token; when that start
    fails before the hookscript took it (the script is gone), the token is withdrawn, not left to waive a later refusal."""
    scen = _scenario({"reset_supported": False, "leak_mib": 0})
    scen["containers"][0]["hookscript"] = "local:snippets/gone"
    node = sim_node(scen)
    r = _pvegpu(node, "gpu-reset", "0", "--yes", "--json")
    doc = _doc(r)
    assert r.returncode == 11 and 129 in doc["left_stopped"] and 130 in doc["restarted"]
    assert any(s["outcome"] == "as-before" for s in doc["steps"])
    assert not os.path.lexists(os.path.join(node.root, "allow-once", "129"))


def test_withdrawing_gpu_resets_token_leaves_a_token_an_admin_wrote_since(tmp_path):
    """withdraw() removes only the token it was given: after an admin's own allow-once of the same CT it stays."""
    from pvegpu.adapters.override import allow_once, withdraw

    d = str(tmp_path / "once")
    ours = allow_once(d, 129)
    admins = allow_once(d, 129)
    assert not withdraw(d, ours) and os.path.exists(admins.path)
    assert withdraw(d, admins) and not os.path.lexists(admins.path)


def test_a_start_as_before_that_may_still_happen_keeps_its_token_and_says_so(sim_node):
    """CT 129's start as before gets no answer (an API timeout): the start may still run its hookscript, so the token is
    kept, and the report names CT 129 as left stopped with a diagnosis."""
    scen = _scenario({"reset_supported": False, "leak_mib": 0})
    scen["containers"][0]["start_no_answer"] = True
    node = sim_node(scen)
    r = _pvegpu(node, "gpu-reset", "0", "--yes", "--json")
    doc = _doc(r)
    assert r.returncode == 11 and 129 in doc["left_stopped"] and 130 in doc["restarted"]
    assert os.path.exists(os.path.join(node.root, "allow-once", "129"))
    assert any(d["kind"] == "left-stopped" and "129" in d["problem"] for d in doc["diagnosis"])


def test_an_api_error_after_the_first_stop_starts_the_stopped_ct_again_and_says_so():
    """CT 130's status read fails once CT 129 is stopped: no exception escapes, CT 129 runs again, the report names the
    error (restart-failed) and the exit is the API's."""
    from pvegpu.core import errors as E
    from pvegpu.core.model import GpuInfo
    from pvegpu.gpureset import GpuResetPolicy, GpuResetPorts, GpuResetReport, execute, make_plan
    from pvegpu.testing import FakeClock, FakeHost, FakeProbe, FakePve

    class Control:
        def persistence(self, gpu, on):
            pass

        def reset(self, gpu):
            pass

        def fabric_manager(self):
            return False

    class FlakyPve(FakePve):
        def ct_status(self, g):
            if g.vmid == 130 and 129 in self.stopped_at:
                raise E.PveApiError("ct_status: 500 proxy error", "try again")
            return super().ct_status(g)

    clock = FakeClock()
    host = FakeHost(clock)
    pve = FlakyPve(host)
    pve.add_ct(129)
    pve.add_ct(130)
    ports = GpuResetPorts(pve, FakeProbe(host), host, clock, Control())
    rep = GpuResetReport(GpuInfo(0, 0, "GPU-x", "0000:41:00.0"))
    make_plan(ports, rep)
    execute(ports, GpuResetPolicy(), rep)
    assert rep.stopped == [129] and 129 in rep.restarted and pve.status[129]["status"] == "running"
    assert any(d.kind == "restart-failed" for d in rep.diagnosis) and rep.exit_code == E.PveApiError.exit_code


def test_sigint_during_the_reset_of_a_gpu_no_ct_uses_lets_the_reset_finish_and_verify(sim_node):
    """No CT on GPU 0: a SIGINT while `nvidia-smi -r` runs does not kill it; the reset finishes, is verified and the
    report says it was interrupted (exit 130)."""
    node = sim_node(_scenario({"reset_hang": 2}, containers=[]))
    p = subprocess.Popen([sys.executable, "-m", "pvegpu", "--simulate", node.root, "gpu-reset", "0", "--yes"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env(), stdin=subprocess.DEVNULL)
    assert p.stdout is not None
    for line in p.stdout:  # the reset's step is printed before nvidia-smi -r runs
        if "nvidia-smi -r" in line:
            break
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "interrupted by SIGINT" in out + err and "was not reset" not in out + err
    assert "leak_mib" not in _gpu(node, 0) and _gpu(node, 0)["recovery_action"] == "none"  # the reset went through


def test_a_drain_mark_that_cannot_be_written_is_a_usage_error_before_anything_stops(tmp_path, monkeypatch):
    """drain() whose write fails (ENOSPC): a UsageError, so no gpu-reset goes on with a GPU the gate does not see draining."""
    import errno as _errno

    from pvegpu.adapters import drain
    from pvegpu.core.errors import UsageError

    with drain.gpu_lock(str(tmp_path / "drain"), 0, "GPU 0") as lock:
        def full(*a, **kw):
            raise OSError(_errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(drain.os, "pwrite", full)
        with pytest.raises(UsageError):
            lock.drain()


def test_waiting_for_a_cts_reset_lock_says_so(sim_node):
    """A pvegpu reset holds CT 129's lock for 1.5 s: gpu-reset waits for it, saying what it waits for, then goes on."""
    import threading

    from pvegpu.adapters.locks import ct_lock

    node = sim_node(_scenario({"leak_mib": 0}))
    release = threading.Event()
    held = threading.Event()

    def hold() -> None:
        with ct_lock(os.path.join(node.root, "lock"), 129, 0):
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    threading.Timer(1.5, release.set).start()
    r = _pvegpu(node, "gpu-reset", "0", "--yes")
    t.join(10)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "waiting for the reset lock of CT 129" in r.stdout


def test_a_node_whose_name_cannot_be_told_plans_no_other_nodes_guests():
    """local_node() says nothing: make_plan is a UsageError (nothing stopped), never a plan of every node's CTs."""
    from pvegpu.core import errors as E
    from pvegpu.core.model import GpuInfo
    from pvegpu.gpureset import GpuResetPorts, GpuResetReport, make_plan
    from pvegpu.testing import FakeClock, FakeHost, FakeProbe, FakePve

    clock = FakeClock()
    host = FakeHost(clock)
    pve = FakePve(host)
    pve.add_ct(129)
    pve.node = ""
    rep = GpuResetReport(GpuInfo(0, 0, "GPU-x", "0000:41:00.0"))
    with pytest.raises(E.UsageError):
        make_plan(GpuResetPorts(pve, FakeProbe(host), host, clock, None), rep)  # type: ignore[arg-type]
    assert rep.guests == []


def test_each_ct_start_has_its_own_deadline_after_long_stops():
    """Three CTs whose stop tasks take 110 s each (the stops alone use half of one reset's budget, with the GPU's reset
    after them): every CT still gets its start's full deadline and runs again."""
    from pvegpu.gpureset import GpuResetPolicy, GpuResetPorts, GpuResetReport, execute, make_plan
    from pvegpu.testing import FakeClock, FakeHost, FakeProbe, FakePve

    class SlowControl:
        def __init__(self, clock):
            self.clock = clock

        def persistence(self, gpu, on):
            pass

        def reset(self, gpu):
            self.clock.sleep(400)  # a slow reset (nvidia-smi -r under its own deadline)

        def fabric_manager(self):
            return False

    clock = FakeClock()
    host = FakeHost(clock)
    pve = FakePve(host)
    for vmid in (129, 130, 131):
        pve.add_ct(vmid, stop_secs=110, start_secs=100)
    probe = FakeProbe(host)
    ports = GpuResetPorts(pve, probe, host, clock, SlowControl(clock))
    rep = GpuResetReport(probe.gpus()[0])
    make_plan(ports, rep)
    execute(ports, GpuResetPolicy(), rep)
    assert rep.restarted == [129, 130, 131] and not rep.left_stopped
