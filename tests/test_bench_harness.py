"""The reset side by side's own logic on CPU (no GPU): scenarios, verdicts, truth, collateral, tables, the pvesh
stand-in and the PVE-like containers (bench/sbs_model.py, bench/pvesh_shim.py, bench/sbs_node.py)."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from bench import common as C
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
    rep = {"elapsed_s": 0.3, "signalled": [{"t": 105.25}, {"t": 105.2}],
           "steps": [{"name": "verify", "seconds": 0.12, "msg": "NVML agrees: memory back after 0.12 s (held for 0.25 s)"}]}
    assert M.pvegpu_phases(json.dumps(rep), t0=105.0, wall=0.5) == {"reset_s": 0.3, "startup_s": 0.2, "first_signal_s": 0.2,
                                                                      "memory_back_s": 0.12, "settle_s": 0.25}
    rep["steps"][0]["msg"] = "clean"  # no settle named: none reported
    assert "settle_s" not in M.pvegpu_phases(json.dumps(rep), t0=105.0, wall=0.5)
    assert M.pvegpu_phases("not json", 0, 1) == {}


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


def test_json_round_trip():
    """Raw JSON (reset.py --raw) holds every field and reads back into the same runs."""
    meta = {"command": "python3 bench/reset.py --raw x", "node": "gpu"}
    meta2, runs2 = M.from_json(M.to_json(meta, _runs()))
    assert meta2 == meta and runs2 == _runs()


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


# -- the budget scripts' shared part (bench/common.py) ----------------------------------------------------------------


def test_rotation_pairs_every_method_once_per_round_and_moves_the_first():
    """Each round runs every method once; the one that runs first changes from round to round."""
    assert C.rotation(["a", "b", "c"], 4) == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert C.rotated(["a", "b"], 1) == ["b", "a"] and C.rotation([], 3) == []


def test_paired_collects_times_by_method_and_drops_missing_ones():
    """paired() calls the methods interleaved and keeps a method's None (no time) out of its list."""
    calls = []

    def method(name, value):
        def run():
            calls.append(name)
            return value
        return run

    got = C.paired({"gate": method("gate", 0.05), "smi": method("smi", None)}, 2)
    assert got == {"gate": [0.05, 0.05], "smi": []} and calls == ["gate", "smi", "smi", "gate"]


@pytest.mark.parametrize("budget,ours,other,floor,ratio,met", [
    (C.Budget("at_most_s", 0.150), 0.149, None, None, "–", True),
    (C.Budget("at_most_s", 0.150), 0.151, 0.03, None, "5.03×", False),
    (C.Budget("over_floor_s", 0.25), 0.60, None, 0.40, "floor +0.20 s", True),
    (C.Budget("over_floor_s", 0.25), 0.70, None, 0.40, "floor +0.30 s", False),
    (C.Budget("over_floor_s", 0.25), 0.70, None, None, "–", None),
    (C.Budget("times_faster", 4), 0.75, 3.1, None, "4.1× faster", True),
    (C.Budget("times_faster", 4), 0.80, 3.1, None, "3.9× faster", False),
    (C.Budget("times_other", 1.5), 0.12, 0.08, None, "1.50×", True),
    (C.Budget("times_other", 1.0), 0.81, 0.80, None, "1.01×", False),
    (C.Budget("times_other", 1.0), None, 0.80, None, "–", None),
])
def test_budget_ratio_and_verdict(budget, ours, other, floor, ratio, met):
    """Each budget kind compares the medians its way; a missing median is not measurable (None), never met."""
    assert budget.ratio(ours, other, floor) == ratio and budget.met(ours, other, floor) is met


def test_row_cells_say_met_not_met_and_why():
    """A row shows medians with their minimum and count, the budget, and met; failed runs make it not met, by name."""
    row = C.Row("gate, idle", [0.04, 0.05, 0.06], against="`nvidia-smi`", other=[0.03, 0.02], budget=C.Budget("at_most_s", 0.15))
    assert row.cells() == ["gate, idle", "median 50 ms (min 40 ms, 3 runs)", "`nvidia-smi`: median 25 ms (min 20 ms, 2 runs)", "–",
                           "2.00×", "≤ 150 ms", "yes"]
    row.failures = ["1 × exit 10: refused"]
    assert row.cells()[-1] == "**no**: 1 × exit 10: refused"
    no_gpu = C.Row("gate", [1.5], against="`nvidia-smi`", other=None, other_note=C.NO_GPU, budget=C.Budget("at_most_s", 0.15))
    assert no_gpu.cells()[1:4] == ["median 1.50 s (min 1.50 s, 1 run)", "`nvidia-smi`: n/a (no GPU)", "–"] and no_gpu.cells()[-1] == "**no**"


def test_table_is_markdown_with_one_line_per_row():
    """The table has the fixed head and a line per row; a | inside a cell is escaped."""
    text = C.table([C.Row("a|b", [0.1]), C.Row("c", [])])
    lines = text.splitlines()
    assert lines[0] == "| measure | pvegpu | against | physical floor | ratio | budget | met |" and len(lines) == 4
    assert lines[2].startswith("| a\\|b | median 100 ms") and lines[3] == "| c | – | – | – | – | – | – |"


def test_machine_lines_from_cpuinfo_and_nvidia_smi():
    """The CPU's model name (x86 or arm), and the GPUs counted by name with their driver; no GPU says so."""
    assert C.cpu_model("processor\t: 0\nmodel name\t: AMD EPYC  9654 96-Core\nprocessor\t: 1\nmodel name\t: AMD EPYC 9654\n") == "AMD EPYC 9654 96-Core"
    assert C.cpu_model("CPU part\t: 0xd0c\n") == "0xd0c" and C.cpu_model("") == "unknown CPU"
    smi = "NVIDIA H200, 580.159.04, 143771 MiB\nNVIDIA H200, 580.159.04, 143771 MiB\n"
    assert C.gpu_line(smi) == "2 × NVIDIA H200 (143771 MiB), driver 580.159.04" and C.gpu_line("") == C.NO_GPU


def test_result_files_never_overwrite_an_earlier_run(tmp_path):
    """<date>-<budget>.md, then -2, -3 for later runs of the same day: the history stays."""
    import datetime

    when = datetime.datetime(2026, 12, 5, 7, 0, tzinfo=datetime.UTC)
    first = C.result_path(str(tmp_path), "gate", when)
    assert os.path.basename(first) == "2026-12-05-gate.md"
    open(first, "w").close()
    assert os.path.basename(C.result_path(str(tmp_path), "gate", when)) == "2026-12-05-gate-2.md"


def test_report_header_names_date_machine_commit_node_gap_load_and_command():
    """Every result opens with what makes it comparable: when, where, which pvegpu, which node and its gap, the load."""
    import datetime

    rep = C.Report("Budget: x", "python3 bench/gate.py --rounds 2", "simulated node", "no GPU here", ["/v/bin/pvegpu"],
                   when=datetime.datetime(2026, 12, 5, 7, 30, tzinfo=datetime.UTC), load_before="load average: 1.00", load_after="load average: 2.00")
    rep.add("| table |")
    text = rep.markdown(machine_line="AMD EPYC, 2 cores; GPU: n/a (no GPU)", commit_line="abc123", version="pvegpu 0.4.0")
    assert text.splitlines()[:9] == [
        "# Budget: x", "", "- date: 2026-12-05 07:30 UTC", "- machine: AMD EPYC, 2 cores; GPU: n/a (no GPU)",
        "- pvegpu: commit abc123; `/v/bin/pvegpu` (pvegpu 0.4.0)", "- node: simulated node. Gap to a GPU node: no GPU here",
        "- load (`uptime`): before: load average: 1.00; after: load average: 2.00", "- command: `python3 bench/gate.py --rounds 2`", ""]
    assert text.endswith("| table |\n")


def test_node_choice_and_the_pvegpu_command(monkeypatch, tmp_path):
    """auto picks the GPU node only when a GPU answers; --pvegpu is split as a shell would; else the entry point beside
    this python, else PATH's, else ``python -m pvegpu``."""
    assert C.choose_node("auto", gpu=lambda: False) == "sim" and C.choose_node("auto", gpu=lambda: True) == "gpu"
    assert C.choose_node("sim", gpu=lambda: True) == "sim"
    assert C.pvegpu_command("/opt/pvegpu/bin/python -IS '/a b/pvegpu'") == ["/opt/pvegpu/bin/python", "-IS", "/a b/pvegpu"]
    monkeypatch.setattr(C.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(C.shutil, "which", lambda name: None)
    assert C.pvegpu_command("") == [str(tmp_path / "python"), "-m", "pvegpu"]
    (tmp_path / "pvegpu").write_text("#!/bin/sh\n")
    (tmp_path / "pvegpu").chmod(0o755)
    assert C.pvegpu_command("") == [str(tmp_path / "pvegpu")]


def test_holders_from_audit_json_and_fuser_output():
    """Holder PIDs (with their NVML MiB) from `audit --json`, by container or all; fuser's PIDs with access letters."""
    doc = {"nodes": [{"gpus": [{"holders": [{"pid": 10, "vmid": 301, "used_mib": 2048}, {"pid": 11, "vmid": 302, "used_mib": None}]},
                               {"holders": [{"pid": 10, "vmid": 301, "used_mib": 1024}]}]}]}
    assert C.holder_pids(json.dumps(doc)) == {10: 3072.0, 11: 0.0} and C.holder_pids(json.dumps(doc), 302) == {11: 0.0}
    assert C.fuser_pids("  4434  4435m 4436c\n") == {4434, 4435, 4436} and C.fuser_pids("") == set()


def test_sim_gpus_use_the_given_stand_ins():
    """GPU i of a simulated node plays stand_ins[i]; without one it keeps the node's own stand-in file."""
    gpus = C.sim_gpus(2, ["/dev/pts/90"])
    assert gpus[0]["stand_in"] == "/dev/pts/90" and "stand_in" not in gpus[1] and [g["minor"] for g in gpus] == [0, 1]


def test_private_devices_are_character_devices_nobody_else_holds():
    """The simulated node's GPUs are distinct pty character devices while the bench keeps them; closed after."""
    import stat

    with C.PrivateDevices(2) as d:
        assert len(set(d.paths)) == 2 and all(stat.S_ISCHR(os.stat(p).st_mode) for p in d.paths)
    assert d.masters == []


# -- the gate's and the reset's harness (bench/gate.py, bench/reset.py) -------------------------------------------------


def test_gate_row_counts_refusals_as_failures():
    """A gate run that did not allow the clean start fails the budget, whatever its time; nvidia-smi is n/a without a GPU."""
    from collections import Counter

    from bench import gate as G

    row = G.row("idle", {"gate": [0.05, 0.06], "nvidia-smi": []}, Counter({"allowed (exit 0)": 1, "exit 10: refused": 1}), gpu=False)
    assert row.failures == ["1 × exit 10: refused"] and row.other is None and row.cells()[2].startswith("nvidia-smi n/a (no GPU); ")
    stand_in = G.row("idle", {"gate": [0.05], "nvidia-smi": [0.2]}, Counter({"allowed (exit 0)": 1}), gpu=False)
    assert "`bench/sim_smi.py DIR`" in stand_in.cells()[2] and stand_in.cells()[2].endswith("median 200 ms (min 200 ms, 1 run)")
    ok = G.row("shared", {"gate": [0.05], "nvidia-smi": [0.03]}, Counter({"allowed (exit 0)": 1}), gpu=True)
    assert ok.failures == [] and ok.cells()[-1] == "yes" and ok.other == [0.03]


def test_gate_simulated_cases_and_the_guard_found_where_hook_install_put_it(tmp_path):
    """idle: CT 301 stopped on a clean GPU; shared: CT 302 running with 1 GiB on it; the guard is snippets/pvegpu-guard."""
    from bench import gate as G

    idle, shared = G.sim_scenario("idle", ["/dev/pts/90"]), G.sim_scenario("shared", ["/dev/pts/90"])
    assert [c["vmid"] for c in idle["containers"]] == [301] and idle["containers"][0]["status"] == "stopped"
    assert shared["containers"][1] == {"vmid": 302, "name": "shared302", "status": "running", "gpus": [0],
                                       "workloads": [{"kind": "simple", "gpu": 0, "mib": 1024}]}
    (tmp_path / "x" / "snippets").mkdir(parents=True)
    (tmp_path / "x" / "snippets" / "pvegpu-guard").write_text("#!/bin/sh\n")
    assert G.find_guard(str(tmp_path)) == str(tmp_path / "x" / "snippets" / "pvegpu-guard")
    with pytest.raises(RuntimeError, match="wrote none"):
        G.find_guard(str(tmp_path / "x" / "snippets" / "nothing"))


def test_gate_on_the_simulated_node_measures_the_installed_guard(capsys):
    """bench/gate.py runs the guard `pvegpu --simulate DIR hook install` wrote, as PVE does, and reports every case
    with its stand-in and the floor measured in the same rounds."""
    from bench import gate as G

    assert G.main(["--node", "sim", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| gate, ")]
    assert len(rows) == 2 and all(r.count("2 runs") == 3 and "nvidia-smi n/a (no GPU)" in r and "≤ 150 ms" in r for r in rows)
    assert "exits: {'allowed (exit 0)': 2}" in out and "- node: simulated node" in out


@pytest.mark.root(reason="needs root: the GPU node's case installs the guard with `pvegpu hook install`, which a user is refused")
@pytest.mark.skipif(C.has_gpu(), reason="checks the GPU node's setup where no GPU answers (the guard must fail closed)")
def test_gate_gpu_case_installs_the_guard_through_hook_install_with_pve_stand_ins():
    """The GPU node's case writes the guard with `pvegpu --config F hook install 301` (pct logged); here, with no NVML, the
    guard run as PVE runs it refuses the start (fail closed)."""
    from bench import gate as G

    case = G.GpuCase(C.pvegpu_command(), "idle")
    try:
        assert "pct set 301 --hookscript local:snippets/pvegpu-guard" in open(os.path.join(case.tmp, "pve-calls.log")).read()
        assert open(case.guard).read().startswith("#!/bin/sh") and case.env["PVEGPU_CONFIG"] == case.config
        _, p = C.timed([case.guard, "301", "pre-start"], env=case.env)
        assert p.returncode == 10
    finally:
        case.close()
    assert not os.path.exists(case.tmp)


def test_reset_scenarios_on_the_simulated_node():
    """Side-by-side scenarios map to simulated workloads; what the simulated node cannot play is left out (None)."""
    from bench import reset as R

    by = {s.key: R.sim_scenario(s, ["/dev/pts/90"]) for s in M.SCENARIOS}
    assert by["hold-20"]["containers"] == [{"vmid": 301, "name": "ct301", "status": "running", "gpus": [0],
                                            "workloads": [{"kind": "simple", "gpu": 0, "mib": 20480}]}]
    assert [w["mib"] for w in by["spawn"]["containers"][0]["workloads"]] == [4096, 4096, 4096]
    assert by["fork"]["containers"][0]["workloads"][0]["kind"] == "orphan"
    assert by["two-cts"]["containers"][1]["workloads"] == [{"kind": "simple", "gpu": 0, "mib": 12288}]
    assert by["two-cts"]["gpus"][0]["stand_in"] == "/dev/pts/90"
    assert {k for k, v in by.items() if v is None} == {"fd-only", "host-proc", "respawn", "nested", "crowd"}


def test_reset_budget_rows_judge_against_the_floor_and_the_manual_routine():
    """Per scenario: pvegpu's median against the floor's + 0.25 s and against the manual routine's (≥ 4×); a pvegpu run that
    was not clean, or whose clean the truth contradicts, fails both rows."""
    from bench import reset as R

    runs = [_run("hold-20", "pvegpu", "clean", used=0, wall=0.6), _run("hold-20", "pvegpu", "clean", used=0, wall=0.62),
            _run("hold-20", "floor", "clean", used=0, wall=0.16), _run("hold-20", "manual", "clean", used=0, wall=3.1),
            _run("fork", "pvegpu", "clean", used=8000, wall=0.5), _run("fork", "floor", "clean", used=0, wall=0.2),
            _run("fork", "manual", "not clean", used=0, wall=3.0)]
    rows = R.budget_rows(runs, {"hold-20": "one holder"})
    assert [r.measure for r in rows] == ["reset, one holder"] * 2 + ["reset, fork"] * 2
    floor, manual = rows[0].cells(), rows[1].cells()
    assert floor[3:] == ["median 160 ms (min 160 ms, 1 run)", "floor +0.45 s", "≤ floor + 0.25 s", "**no**"]
    assert manual[2] == "manual routine: median 3.10 s (min 3.10 s, 1 run)" and manual[4:] == ["5.1× faster", "≥ 4× faster than manual routine", "yes"]
    assert rows[2].failures == rows[3].failures == ["run 1: clean (FALSE CLEAN): "] and rows[3].cells()[-1].startswith("**no**")


def test_reset_phases_table_takes_medians_of_what_pvegpu_reported():
    """Where pvegpu's time went: medians of its start-up, its own elapsed, memory back and settle; missing ones are –."""
    from bench import reset as R

    a, b = _run("hold-20", "pvegpu", "clean", used=0, wall=0.6), _run("hold-20", "pvegpu", "clean", used=0, wall=0.7)
    a.extra = {"startup_s": 0.15, "reset_s": 0.45, "memory_back_s": 0.16, "settle_s": 0.25}
    b.extra = {"startup_s": 0.25, "reset_s": 0.45}
    assert R.phases_table([a, b]).splitlines()[2] == "| hold-20 | 650 ms | 200 ms | 450 ms | 160 ms | 250 ms |"


def test_reset_methods_on_the_simulated_node_give_the_right_verdicts():
    """On a simulated node each method ends with a verdict the truth one second later agrees with: the floor and pvegpu
    clean, the manual routine's stand-in nvidia-smi clean too (the driver noticed the kill while the routine slept)."""
    from bench import reset as R

    bench = R.SimBench(C.pvegpu_command())
    try:
        s = M.scenarios(["hold-20"], scale=0.05)[0]
        runs = {m: bench.run(s, m) for m in ("floor", "pvegpu", "manual")}
    finally:
        bench.close()
    for m, r in runs.items():
        assert (r.verdict, r.judgement, r.collateral) == ("clean", "right", []), (m, r.detail)
    assert runs["floor"].wall_s < runs["pvegpu"].wall_s < runs["manual"].wall_s and runs["manual"].wall_s >= 3
    assert runs["pvegpu"].extra["memory_back_s"] > 0 and 1000 <= runs["floor"].allocated_mib <= 1100
