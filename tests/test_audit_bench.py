"""The audit side by side's CLI row (``bench/audit_cli.py``) does the audit's whole work: on the bench node, the real
``pvegpu audit --json`` through the entry point finds the holders the in-process audit finds, serial or not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import pvelike


@pytest.mark.root(reason="needs root: the bench node's containers are real cgroups")
def test_the_cli_row_audits_the_bench_node_like_the_in_process_audit(tmp_path):
    """400 sleepers in 100 container cgroups, 4 stand-in holders in each of 26: the CLI (forked workers, and serial)
    reports every container holder the in-process ``run_audit`` reports, with the stand-in NVML's GPUs."""
    from bench.bench_audit import GPUS, STAND_INS, CountingPve, StandInNvml
    from bench.bench_audit_sbs import CTS, cli_holders, spawn_node
    from pvegpu.adapters.nodefiles import LocalNodeFiles
    from pvegpu.adapters.procfs import DeviceTable, ProcHost
    from pvegpu.audit import run_audit

    base = 680000 + (os.getpid() % 1000) * 100
    vmids = [base + i for i in range(CTS)]
    confs = {v: f"arch: amd64\nhostname: ct{i}\ndev0: /dev/nvidia{i % GPUS},gid=44\n" for i, v in enumerate(vmids) if i % 2 == 0}
    root = pvelike.etc_pve(str(tmp_path / "pve"), "bench", confs | {v: "arch: amd64\n" for i, v in enumerate(vmids) if i % 2})
    pids: list[int] = []
    try:
        pids, owners, vmids = spawn_node(400, base)
        time.sleep(0.5)
        state = tmp_path / "state.json"
        state.write_text(json.dumps({"root": root, "owners": owners}))
        table = DeviceTable({(os.major(os.stat(d).st_rdev), os.minor(os.stat(d).st_rdev)): m for m, d in enumerate(STAND_INS)})
        rep = run_audit(pve=CountingPve(root, node="bench"), probe=StandInNvml(owners), host=ProcHost(table, workers=1),
                        files=LocalNodeFiles(root))
        ours = set(vmids)  # other suites may run containers holding the same stand-ins meanwhile
        want = {(h.pid, g.index) for g in rep.gpus for h in g.holders if h.place == "lxc" and h.vmid in ours}
        assert len(want) == 104  # 26 holding containers, 4 holders each
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PVEGPU_PVE_ROOT": root}
        for extra in ({}, {"BENCH_SCAN_WORKERS": "1"}):
            r = subprocess.run([sys.executable, os.path.join(pvelike.REPO, "bench", "audit_cli.py"), str(state), "audit", "--json"],
                               capture_output=True, env=env | extra, timeout=120)
            assert r.returncode in (0, 8), r.stderr.decode()[-2000:]
            doc = json.loads(r.stdout)
            got = {(h["pid"], g["index"]) for n in doc["nodes"] for g in n["gpus"] for h in g["holders"]
                   if h["place"] == "lxc" and h["vmid"] in ours}
            assert got == want and cli_holders(r.stdout) >= 104
            assert [g["uuid"] for g in doc["nodes"][0]["gpus"]] == [f"GPU-bench-{i}" for i in range(GPUS)]
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in pids:
            try:
                os.waitpid(p, 0)
            except ChildProcessError:
                pass
        for v in vmids:
            pvelike.destroy_ct(v)
