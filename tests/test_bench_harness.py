"""The side-by-side benchmark's own logic on CPU (no GPU): scenarios, verdicts, truth, collateral, tables."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from bench import pvesh_shim
from bench import sbs_model as M
from tests import pvelike

ISSUE_SCENARIOS = {"hold-20", "hold-100", "spawn", "fork", "ignore-term", "fd-only", "two-cts", "host-proc", "respawn", "nested", "crowd"}


def _run(scenario: str, method: str, verdict: str, used: float | None, keep: float = 0.0, **kw) -> M.Run:
    truth = M.Truth(used, kw.pop("listed", []), kw.pop("holders", []))
    return M.finish(M.Run(scenario, method, wall_s=kw.pop("wall", 1.0), verdict=verdict, keep_mib=keep, truth=truth, **kw))


# -- scenarios -----------------------------------------------------------------------------------------


def test_every_scenario_of_the_issue_is_there_once():
    """The scenario list covers issue 11's list, each key once, in a fixed order."""
    keys = [s.key for s in M.SCENARIOS]
    assert set(keys) == ISSUE_SCENARIOS and len(keys) == len(set(keys))
    assert [s.key for s in M.scenarios()] == keys


def test_scenario_selection_and_scale():
    """Selecting keeps the caller's order, scale shrinks every allocation, an unknown key is refused by name."""
    chosen = M.scenarios(["two-cts", "hold-20"], scale=0.5)
    assert [(s.key, s.gib, s.neighbour_gib) for s in chosen] == [("two-cts", 4, 6), ("hold-20", 10, 0)]
    with pytest.raises(ValueError, match="nope"):
        M.scenarios(["hold-20", "nope"])


def _script(key: str) -> str:
    s = next(x for x in M.SCENARIOS if x.key == key)
    return M.workload_script(s, "/usr/bin/python3", "/r/bench/cuda_hold.py", "/tmp/rd", 3, "/sys/fs/cgroup/lxc/301/ns")


def test_workload_scripts_build_what_the_scenario_names():
    """Each scenario's container payload: flags, the nested cgroup move, 300 idle sleepers, a respawn loop, a bare fd."""
    assert shlex.split(_script("hold-100").strip()) == ["exec", "/usr/bin/python3", "/r/bench/cuda_hold.py", "--gib", "100", "--ready", "/tmp/rd/ready"]
    assert "--workers 3" in _script("spawn") and "--fork-after-init" in _script("fork") and "--ignore-term" in _script("ignore-term")
    nested = _script("nested").splitlines()
    assert nested[0] == "echo $$ > /sys/fs/cgroup/lxc/301/ns/system.slice/app.service/cgroup.procs" and nested[1].startswith("exec ")
    assert "-lt 300 ]" in _script("crowd").splitlines()[0]
    assert _script("respawn").startswith("while :; do /usr/bin/python3") and "sleep 0.1; done" in _script("respawn")
    fd = _script("fd-only")
    assert "/dev/nvidia3" in fd and "cuda_hold" not in fd and "python" not in fd  # pkill python must miss it


def test_ready_markers_per_scenario():
    """Spawn workers each mark ready; every other workload marks once."""
    counts = {s.key: M.ready_count(s) for s in M.SCENARIOS}
    assert counts["spawn"] == 3 and {v for k, v in counts.items() if k != "spawn"} == {1}


# -- verdicts ------------------------------------------------------------------------------------------


def test_smi_parsing_and_the_admins_verdict():
    """nvidia-smi's csv reads per index; clean means back at idle within the threshold; no line is an error."""
    out = "0, 64\n1, 20480\ngarbage\n2, n/a\n"
    assert M.parse_smi(out) == {0: 64.0, 1: 20480.0}
    assert M.verdict_from_smi(out, 0, idle_mib=0)[0] == "clean"
    assert M.verdict_from_smi(out, 1, idle_mib=0) == ("not clean", "nvidia-smi: 20480 MiB used (idle 0)")
    assert M.verdict_from_smi(out, 2, idle_mib=0)[0] == "error"


def test_pvegpu_verdict_needs_exit_zero_and_clean():
    """pvegpu's verdict is clean only for exit 0 with outcome clean; a restart is noted; no JSON is an error."""
    rep = {"outcome": "clean", "elapsed_s": 0.4, "restarted": True, "signalled": [{"result": "sent"}, {"result": "gone"}]}
    verdict, detail, extra = M.verdict_from_pvegpu(0, json.dumps(rep))
    assert verdict == "clean" and "after a restart" in detail and extra["signalled"] == 1
    assert M.verdict_from_pvegpu(6, json.dumps(rep | {"outcome": "not clean"}))[0] == "not clean"
    assert M.verdict_from_pvegpu(4, json.dumps(rep | {"outcome": "clean, but the restart failed"}))[0] == "not clean"
    assert M.verdict_from_pvegpu(2, "Error: bad\n")[0] == "error"


def test_truth_counts_target_holders_and_memory_above_others():
    """Truth: dirty when a target process is listed or holds the device, or memory exceeds what others held."""
    assert M.truth_clean(M.Truth(12_300.0), keep_mib=12_288) is True
    assert M.truth_clean(M.Truth(12_288 + 65.0), keep_mib=12_288) is False
    assert M.truth_clean(M.Truth(0.0, holders := [], [4242]), keep_mib=0) is False and holders == []
    assert M.truth_clean(M.Truth(0.0, [{"pid": 1, "owner": "target", "mib": 0}]), keep_mib=0) is False
    assert M.truth_clean(M.Truth(9000.0, [{"pid": 1, "owner": "CT 302", "mib": 9000}]), keep_mib=9000) is True
    assert M.truth_clean(M.Truth(None), keep_mib=0) is None


@pytest.mark.parametrize("verdict,truth,want", [
    ("clean", True, "right"), ("not clean", False, "right"), ("clean", False, "FALSE CLEAN"),
    ("not clean", True, "false alarm"), ("error", True, "no verdict"), ("clean", None, "truth unknown"),
])
def test_judgement_matrix(verdict, truth, want):
    """A verdict compared with the truth: right, the dangerous false clean, a false alarm, or no verdict."""
    assert M.judge(verdict, truth) == want


def test_finish_fills_truth_and_judgement():
    """finish() judges a run from its own verdict, truth and the memory others legitimately held."""
    shared = _run("two-cts", "manual", "not clean", used=12_500, keep=12_500)
    assert (shared.truth_clean, shared.judgement) == (True, "false alarm")
    respawned = _run("respawn", "manual", "clean", used=4_600, keep=0)
    assert respawned.judgement == "FALSE CLEAN"
    crashed = M.finish(M.Run("hold-20", "pvegpu", verdict="error", detail="boom"))
    assert (crashed.truth_clean, crashed.judgement) == (None, "no verdict")


# -- collateral and baseline ---------------------------------------------------------------------------


def test_collateral_counts_gone_and_recycled_pids():
    """An outside process that is gone, or whose PID now has another start time, was hurt; the rest were not."""
    before = {10: (100, "python3", "CT 302"), 11: (101, "python3", "host"), 12: (102, "sleep", "CT 302")}
    hurt = M.collateral(before, {10: 100, 11: None, 12: 999})
    assert hurt == [{"pid": 11, "comm": "python3", "owner": "host"}, {"pid": 12, "comm": "sleep", "owner": "CT 302"}]
    assert M.collateral(before, {10: 100, 11: 101, 12: 102}) == []


def test_baseline_problem_names_what_is_wrong():
    """A run starts only from an idle GPU: readable, no listed process, used back at idle."""
    assert M.baseline_problem(10.0, [], idle_mib=0) is None
    assert M.baseline_problem(None, [], idle_mib=0) == "the GPU cannot be read"
    assert "3, 7" in M.baseline_problem(0.0, [7, 3], idle_mib=0)
    assert M.baseline_problem(500.0, [], idle_mib=0) == "500 MiB used, idle is 0 MiB"


# -- pvegpu's phases -----------------------------------------------------------------------------------


def test_pvegpu_phases_split_startup_from_the_reset():
    """Start-up is wall minus the reset's own elapsed; the first signal is timed on the shared monotonic clock."""
    rep = {"elapsed_s": 0.3, "signalled": [{"t": 105.25}, {"t": 105.2}], "steps": [{"name": "verify", "seconds": 0.12}]}
    assert M.pvegpu_phases(json.dumps(rep), t0=105.0, wall=0.5) == {"reset_s": 0.3, "startup_s": 0.2, "first_signal_s": 0.2, "memory_back_s": 0.12}
    assert M.pvegpu_phases("not json", 0, 1) == {}


def test_import_profile_keeps_top_level_imports():
    """-X importtime lines: nested imports are folded into their top-level parent; the largest come first."""
    err = ("import time: self [us] | cumulative | imported package\n"
           "import time:       100 |        100 |     _io\n"
           "import time:       200 |      30000 |   typer.core\n"
           "import time:       300 |      45000 | typer\n"
           "import time:       400 |       5000 | json\n"
           "{\"event\": \"reset.locate\"}\n")
    assert M.import_profile(err) == {"total_ms": 50.0, "top": [["typer", 45.0], ["json", 5.0]]}


# -- output --------------------------------------------------------------------------------------------


def _runs() -> list[M.Run]:
    return [
        _run("hold-20", "manual", "clean", used=0, wall=3.1),
        _run("hold-20", "restart", "clean", used=0, wall=0.2),
        _run("hold-20", "pvegpu", "clean", used=0, wall=0.5),
        _run("two-cts", "manual", "not clean", used=12_500, keep=12_500, wall=3.2),
        _run("two-cts", "restart", "not clean", used=12_500, keep=12_500, wall=0.3),
        _run("two-cts", "pvegpu", "clean", used=12_500, keep=12_500, wall=0.4,
             collateral=[{"pid": 9, "comm": "python3", "owner": "CT 302"}],
             listed=[{"pid": 9, "owner": "CT 302", "mib": 12_400}]),
    ]


def test_summary_table_rows_ratios_and_marks():
    """One row per scenario with each method's wall and verdict, wrong verdicts and hurt processes marked, ratios to pvegpu."""
    lines = M.summary_table(_runs()).splitlines()
    assert lines[0].startswith("| scenario | manual | restart | pvegpu |") and len(lines) == 4
    hold = lines[2]
    assert "| one holder, 20 GiB | 3.10 s clean | 0.20 s clean | 0.50 s clean | – | 6.2× | 0.4× | – |" == hold
    shared = lines[3]
    assert "3.20 s not clean **false alarm**" in shared and "0.40 s clean, hurt 1" in shared and "| 8.0× | 0.7× | – |" in shared


def test_ratio_without_numbers_is_a_dash():
    """No wall time (an error) gives no ratio rather than a made-up one."""
    assert M.ratio(None, 1.0) == "–" and M.ratio(1.0, 0.0) == "–" and M.ratio(3.0, 0.5) == "6.0×"
    runs = [M.finish(M.Run("fork", "manual", verdict="error")), _run("fork", "pvegpu", "clean", used=0)]
    assert M.summary_table(runs).splitlines()[2].endswith("| – | – | – |")


def test_summary_table_says_how_far_pvegpu_is_above_the_floor():
    """With a floor run in the same scenario, the last column is pvegpu's median wall minus the floor's."""
    runs = [_run("hold-20", "pvegpu", "clean", used=0), _run("hold-20", "floor", "clean", used=0)]
    runs[0].wall_s, runs[1].wall_s = 0.62, 0.55
    assert M.summary_table(runs).splitlines()[2].endswith("| +0.07 s |") and M.over(None, 1.0) == "–"


def test_detail_table_shows_truth_and_collateral():
    """The detail rows carry the evidence: used vs others', listed PIDs with owners, target holders, the hurt."""
    text = M.detail_table(_runs())
    row = text.splitlines()[-1]
    assert "| two-cts | pvegpu | 0.400 s |" in row and "12500 / 12500" in row and "9 (CT 302)" in row and "9 python3 (CT 302)" in row


def test_json_round_trip_and_markdown(tmp_path):
    """Raw JSON holds every field and reads back into the same runs; the markdown names machine and command."""
    meta = {"machine": "H200", "driver": "580", "when": "today", "command": "python3 bench/side_by_side.py --out x"}
    text = M.to_json(meta, _runs())
    meta2, runs2 = M.from_json(text)
    assert meta2 == meta and runs2 == _runs()
    md = M.markdown(meta, _runs())
    assert md.startswith("Machine: H200; driver 580; today\nCommand: `python3 bench/side_by_side.py --out x`")


# -- the pvesh stand-in --------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,want", [
    (["get", "/nodes/sbs/lxc/301/status/current", "--output-format", "json"], ("status", 301)),
    (["create", "/nodes/sbs/lxc/301/status/stop"], ("stop", 301)),
    (["create", "/nodes/sbs/lxc/301/status/start"], ("start", 301)),
    (["get", "/nodes/sbs/tasks/UPID:sbs:1:0:0:vzstop:301:root@pam:/status"], ("task", "UPID:sbs:1:0:0:vzstop:301:root@pam:")),
    (["get", "/nodes/sbs/tasks/UPID:x/log"], ("log", "UPID:x")),
    (["get", "/nodes/sbs/lxc/301/status/stop"], ("unsupported", "/nodes/sbs/lxc/301/status/stop")),
    (["create", "/nodes/sbs/qemu/301/status/stop"], ("unsupported", "/nodes/sbs/qemu/301/status/stop")),
    (["get"], ("unsupported", "")),
])
def test_pvesh_routes_only_the_calls_a_reset_makes(argv, want):
    """The benchmark's pvesh answers status, stop, start and task reads of a CT; anything else is refused."""
    assert pvesh_shim.route(argv) == want


def test_pvesh_refuses_unknown_calls_with_an_http_like_error(tmp_path, capsys, monkeypatch):
    """An unsupported call exits 2 with a 501 line on stderr (proxmoxer reads the status from it) and is logged."""
    log = tmp_path / "pvesh.log"
    monkeypatch.setenv("SBS_PVESH_LOG", str(log))
    assert pvesh_shim.main(["delete", "/nodes/sbs/lxc/301"]) == 2
    assert capsys.readouterr().err.startswith("501 ") and log.read_text() == "delete /nodes/sbs/lxc/301\n"
    assert pvesh_shim.main(["get", "/nodes/sbs/tasks/UPID:x/status"]) == 0
    assert json.loads(capsys.readouterr().out) == {"status": "stopped", "exitstatus": "OK", "upid": "UPID:x"}


def test_pvesh_launcher_is_an_executable_for_path(tmp_path):
    """The launcher is an executable file named pvesh that runs this module's main with the repo importable."""
    path = pvesh_shim.launcher(str(tmp_path), "/repo", "/usr/bin/python3")
    assert os.path.basename(path) == "pvesh" and os.access(path, os.X_OK)
    assert open(path).read().startswith("#!/usr/bin/python3 -I\n") and "'/repo'" in open(path).read()


def test_event_timeline_from_pvegpu_json_lines():
    """pvegpu's JSON-line events become seconds since the process started, first occurrence of each, verify by outcome."""
    err = ("import time: noise\n"
           '{"event": "reset.locate", "level": "info", "timestamp": "2026-11-30T07:00:00.300000Z"}\n'
           '{"event": "reset.signal", "timestamp": "2026-11-30T07:00:00.320000Z"}\n'
           '{"event": "reset.signal", "timestamp": "2026-11-30T07:00:00.330000Z"}\n'
           '{"event": "reset.verify", "outcome": "clean", "timestamp": "2026-11-30T07:00:00.700000Z"}\n'
           '{"event": "broken", "timestamp": "yesterday"}\n')
    t0 = 1_796_022_000.0  # 2026-11-30T07:00:00Z
    assert M.event_timeline(err, t0) == {"reset.locate": 0.3, "reset.signal": 0.32, "reset.verify:clean": 0.7}


# -- the PVE-like containers (real cgroups and namespaces; root, no GPU) ----------------------------------

_MASTER, GPU, GPU_RDEV = pvelike.private_device()  # a stand-in device number no other process on the machine holds


@pytest.fixture
def vmid():
    """A container id no other test or engineer uses; whatever is left of it is stopped afterwards."""
    from bench import sbs_node as N

    v = 700_000 + os.getpid() % 100_000
    yield v
    N.kill_ct(v)


def _wait(pred, what: str, timeout: float = 10):
    import time

    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.02)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and PID namespaces")
def test_container_is_pve_shaped_and_its_init_reaps(vmid):
    """A container has its init as PID 1 in /lxc/<vmid>/ns, the monitor in /lxc.monitor/<vmid>, a nested
    service cgroup, and an init that reaps orphans (no zombie is left after a payload process dies)."""
    from bench import sbs_node as N

    script = f"(sleep 0.2 &) ; echo $$ > {N.ns_cgroup(vmid)}/{M.NESTED_CGROUP}/cgroup.procs; exec sleep 60"
    init = N.start_ct(vmid, script, subcgroups=(M.NESTED_CGROUP,))
    assert N.ns_pid(init) == 1 and N.comm(init) == "init" and N.cgroup_of(init) == f"/lxc/{vmid}/ns"
    with open(os.path.join(N.monitor_cgroup(vmid), "cgroup.procs")) as f:
        monitor = [int(p) for p in f.read().split()]
    assert monitor and all(N.cgroup_of(p) == f"/lxc.monitor/{vmid}" for p in monitor)
    _wait(lambda: any(N.cgroup_of(p) == f"/lxc/{vmid}/ns/{M.NESTED_CGROUP}" for p in N.ct_pids(vmid)), "payload not in the nested cgroup")

    def states() -> list[str]:
        out = []
        for p in N.ct_pids(vmid):
            try:
                with open(f"/proc/{p}/stat") as f:
                    out.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        return out

    _wait(lambda: len(N.ct_pids(vmid)) == 2, "the orphaned sleep did not exit and get reaped")
    assert "Z" not in states()
    assert N.find_init(vmid) == init and N.owner(init, vmid) == "target" and N.owner(init, vmid + 1) == f"CT {vmid}"


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for cgroups and PID namespaces")
def test_device_holders_and_collateral_on_real_processes(vmid):
    """The fd scan finds the container's holder of a device by number; a stop leaves an outside process
    alone and the collateral check says so, and names it once it is gone."""
    import subprocess

    from bench import sbs_node as N

    N.start_ct(vmid, f"exec 3<>{GPU}; exec sleep 60")
    _wait(lambda: N.device_holders(N.ct_pids(vmid), {(os.major(GPU_RDEV), os.minor(GPU_RDEV))}), "holder not found")
    holder = N.device_holders(N.ct_pids(vmid), {(os.major(GPU_RDEV), os.minor(GPU_RDEV))})
    assert [N.comm(p) for p in holder] == ["sleep"] and N.device_holders(holder, {(195, 0)}) == []
    outside = subprocess.Popen(["sleep", "60"])
    try:
        before = N.identities([outside.pid], vmid)
        assert before[outside.pid][1:] == ("sleep", "host")
        assert N.kill_ct(vmid) and not os.path.exists(N.ct_cgroup(vmid)) and not os.path.exists(N.monitor_cgroup(vmid))
        assert M.collateral(before, {p: N.start_time(p) for p in before}) == []
    finally:
        outside.kill()
        outside.wait()
    assert M.collateral(before, {p: N.start_time(p) for p in before}) == [{"pid": outside.pid, "comm": "sleep", "owner": "host"}]
