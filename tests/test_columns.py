"""`audit`, `check`, `reset` (a CT's and a VM's report) and `demo` read in 80 columns (--wide/-v: one line per item,
every detail): user names, not `uid 0`; the telling part of a command line, elided in the middle, by terminal columns
(wide characters count two); tenant text still escaped and wrapped whole."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata

from pvegpu.adapters.users import user_name
from pvegpu.audit.render import audit_table
from pvegpu.cli.render import reset_human, step_line
from pvegpu.core.holders import GpuFacts
from pvegpu.core.model import MIB, GpuInfo, GpuSample, Holder, Place, Placement, ProcIdentity, ProcInfo
from pvegpu.core.safetext import escape
from pvegpu.core.textfit import command, elide, fit
from pvegpu.reset.report import ResetOutcome, ResetReport
from pvegpu.reset.vocab import Diagnosis, Kind
from pvegpu.sim import scenario as sc
from pvegpu.vm.reset import VmOutcome, VmReport, vm_human
from tests.pvelike import REPO

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)")


def _columns(line: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 0 if unicodedata.combining(c) else 1 for c in line)


def _width(text: str) -> int:
    """The widest line in terminal columns (wide/full-width characters 2, combining marks 0), colour codes removed."""
    return max((_columns(ANSI.sub("", line)) for line in text.splitlines()), default=0)


def _pvegpu(*args):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    r = subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=90,
                       env=clean | {"PVEGPU_GATE_DEADLINE": "25"})
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_audit_and_check_of_the_demo_scenario_fit_80_columns(sim_node):
    """On the demo scenario every line of `audit` and of `check` for each guest fits 80 columns (ANSI stripped);
    `--wide` keeps the whole command line on one line."""
    node = sim_node(sc.DEMO)
    r = _pvegpu("--simulate", node.root, "audit")
    assert r.returncode in (0, 8) and "CT 129" in r.stdout and _width(r.stdout) <= 80, r.stdout
    guests = [c["vmid"] for c in sc.DEMO["containers"]] + [v["vmid"] for v in sc.DEMO["vms"]]
    for vmid in guests:
        r = _pvegpu("--simulate", node.root, "check", str(vmid))
        assert r.returncode in (0, 10) and _width(r.stdout) <= 80, r.stdout
    wide = _pvegpu("--simulate", node.root, "audit", "--wide")
    assert _width(wide.stdout) > 80 and "pvegpu.sim.init" in wide.stdout
    one = _pvegpu("--simulate", node.root, "check", "129", "-v")  # CT 129 runs: no start to decide (exit 0)
    assert one.returncode == 0 and len(one.stdout.strip().splitlines()) == 1


def _holder(**over):
    h = {"pid": 4194301, "ns_pid": 4194302, "comm": "python3", "uid": 100000, "user": None, "place": "lxc", "vmid": 999999999,
         "id": "lxc/999999999", "hostname": "a-very-long-hostname-of-the-tenant-that-goes-on", "owner": "CT 999999999",
         "used_bytes": 143771 * 2**20, "via": ["fd", "maps", "nvml"],
         "cmdline": "/opt/venvs/some/deep/path/to/a/virtualenv/bin/python3 -m torch.distributed.run --nproc 8 train.py "
                    "--data /mnt/datasets/imagenet/very/long/path --out /mnt/ckpt/run-2026-12-01"}
    return h | over


def _doc(holders, detail="x" * 300):
    gpu = {"index": 0, "minor": 0, "bus_id": "00000000:41:00.0", "name": "NVIDIA H200 NVL with a long name",
           "uuid": "GPU-5f0c3a4e-1b2d-4c3e-9f10-aa11bb22cc33", "readable": True, "used_bytes": 1, "reserved_bytes": 1,
           "total_bytes": 150754820096, "unattributed_bytes": 0, "health": {"mig_enabled": False},
           "granted_to": [f"lxc/{100 + i}" for i in range(30)], "flags": ["shared", "unattributed-memory"], "holders": holders,
           "dead_pids": [4194303]}
    flag = {"kind": "unattributed-memory", "subject": "GPU 0", "detail": detail, "advice": "a " * 100, "attention": True}
    guest = {"id": "lxc/999999999", "name": "n" * 40, "status": "running", "node": "pve-node-with-long-name", "all_gpus": False,
             "minors": list(range(12)), "notes": ["pending: /dev/nvidia3 added", "snapshot differs"]}
    return {"nodes": [{"node": "pve1", "ok": True, "gpus": [gpu], "guests": [guest], "flags": [flag]}], "attention": True}


def test_worst_case_rows_fit_80_columns_and_wide_keeps_everything():
    """7-digit pids, a 9-digit vmid, a long hostname, command line, flag detail and guest list: every line fits
    80 columns; --wide has the whole command line."""
    doc = _doc([_holder(), _holder(place="host", owner="host", vmid=None, hostname=None, ns_pid=None, via=["fd"])])
    text = audit_table(doc)
    assert _width(text) <= 80, text
    assert "python3 -m torch.distributed.run" in text and "run-2026-12-01" in text  # head and tail of the command both shown
    assert _holder()["cmdline"] in audit_table(doc, wide=True)


def test_audit_with_a_wide_character_command_line_fits_80_terminal_columns():
    """A tenant command line of CJK characters (two terminal columns each) still fits 80 terminal columns in audit."""
    text = audit_table(_doc([_holder(cmdline="python3 " + "\u8bad\u7ec3" * 40, comm="python3")]))
    widest = max(text.splitlines(), key=_columns)
    assert _columns(widest) <= 80, widest

def test_holders_show_user_names_or_the_host_uid():
    """A holder with a host user name shows it; a container's mapped uid with no passwd entry shows the number."""
    text = audit_table(_doc([_holder(uid=0, user="root"), _holder(uid=100000, user=None, pid=77)]))
    lines = text.splitlines()
    assert any("pid 4194301" in ln and " root " in ln for ln in lines) and "uid 0" not in text
    assert any("pid 77" in ln and "uid 100000" in ln for ln in lines)
    assert user_name(0) == "root" and user_name(2**31 - 7) is None


def test_tenant_text_stays_escaped_when_elided_and_wrapped():
    """A command line and a flag detail carrying terminal escapes are shown escaped, in both forms."""
    evil = "\x1b[2J\x1b]0;owned\x07/bin/sh -c " + "A" * 200 + " \x1b[31m"
    doc = _doc([_holder(cmdline=evil, comm="\x1b[2Jsh")], detail="pid 5 (\x1b[2J) holds it")
    for text in (audit_table(doc), audit_table(doc, wide=True)):
        assert "\x1b" not in text and "\x07" not in text and "\\x1b[2J" in text


def test_command_is_the_basename_and_arguments_elided_in_the_middle():
    """argv[0]'s directory goes, the arguments stay; too long: cut in the middle, so its start and end both show."""
    assert command("/opt/venv/bin/python3 -m train --data /x") == "python3 -m train --data /x"
    long = command("/usr/bin/python3 " + " ".join(f"--arg{i}" for i in range(40)), width=40)
    assert len(long) == 40 and long.startswith("python3 --arg0") and long.endswith("--arg39") and "..." in long
    assert command("", "kworker/0:1") == "[kworker/0:1]" and elide("abcdef", 5) == "a...f"


def test_fit_keeps_a_quoted_command_whole():
    """Wrapping breaks at spaces, never inside a `quoted command` that fits a line."""
    lines = fit("fix: " + "word " * 12 + "`nvidia-smi -r -i 0` and more words after it", "", "  ", width=40)
    assert any("`nvidia-smi -r -i 0`" in ln for ln in lines) and all(len(ln) <= 40 for ln in lines)


def test_elide_and_fit_count_terminal_columns_not_characters():
    """Wide (CJK) characters take two columns and combining marks none: elide and fit stay within their width."""
    wide = "\u8bad\u7ec3" * 30
    assert _columns(elide(wide, 21)) <= 21 and "..." in elide(wide, 21)
    assert elide("e\u0301" * 10, 10) == "e\u0301" * 10  # ten columns, twenty characters: nothing to cut
    lines = fit("run " + wide + " `a b` end", "  ", "    ", 30)
    assert all(_columns(line) <= 30 for line in lines) and "`a b`" in "".join(lines)


# -- reset's and demo's human output ---------------------------------------------------------------------------


def _widest_ct_report():
    """The widest realistic container report: ten neighbours on the GPU, a dry-run plan for a tenant's long
    escaped comm and nested cgroup, respawn notes, every diagnosis kind of line, left stopped, interrupted."""
    comm = escape("\x1b[2J\x1b]0;pwn\x07trainer")  # a tenant's comm, escaped
    cgroup = "/lxc/129/" + "/".join(escape(f"ns{i}\x1b") for i in range(12))

    def holder(pid, vmid):
        place = Placement(Place.CONTAINER if vmid else Place.HOST, vmid)
        return Holder(ProcInfo(ProcIdentity(pid, 1), comm, "S", place, cgroup, pid), frozenset({0}), frozenset({"fd"}))

    gpu = GpuInfo(0, 0, "GPU-0", "0000:41:00.0")
    others = [holder(5000 + v, v) for v in range(130, 140)] + [holder(4999, None)]
    before = GpuFacts(gpu, GpuSample(0, 143_771 * MIB, ()), ct_holders=[holder(4000 + i, 129) for i in range(12)], other_holders=others)
    after = GpuFacts(gpu, GpuSample(0, 99_000 * MIB, ()), other_holders=others)
    long = f"pid 4001 ({comm}, CT pid 4001) in CT 129 still holds GPU 0 (/dev/nvidia0, GPU-0) (state D) " * 2
    r = ResetReport(129, "pve1", gpus=[0], before={0: before}, after={0: after}, outcome=ResetOutcome.NOT_VERIFIED, exit_code=130,
                    left_stopped=True, interrupted={"signal": "SIGINT", "action": "abandoned the restart at the second signal"},
                    plan=[{"pid": 4000, "comm": comm, "ns_pid": 4000, "cgroup": cgroup, "action": "SIGTERM, SIGKILL after the grace"}],
                    notes=[f"pid 4100 ({comm}, CT pid 4100) appeared after round 1, started by the container's init (pid 4, {comm})"],
                    diagnosis=[Diagnosis(Kind.HOLDER_LEFT, long, f"`pct exec 129 -- kill -9 4001` {long}"),
                               Diagnosis(Kind.NEIGHBOUR, long)], elapsed=31.25)
    return r, comm


def test_the_widest_reset_report_fits_80_columns_and_wide_keeps_one_line_per_item():
    """reset's report and step lines fit 80 columns with the tenant's text wrapped whole; -v keeps one line per item."""
    r, comm = _widest_ct_report()
    text = reset_human(r)
    assert _width(text) <= 80, text
    flat = " ".join(text.split())
    for whole in (comm, *(f"CT {v}" for v in range(130, 140)), "host", " ".join(r.diagnosis[0].problem.split())):
        assert whole in flat
    step = step_line("signal", f"SIGTERM → pid 4000 ({comm}, CT pid 4000, {r.plan[0]['cgroup']}): sent")
    assert _width(step) <= 80 and " ".join(step.split()).endswith("): sent")
    wide = reset_human(r, wide=True)
    assert len(wide.splitlines()) == 2 + 1 + 1 + 1 + 3 + 1 + 1  # table (2), plan, note, verdict, diagnosis (3), left stopped, interrupted
    assert len(step_line("signal", "x " * 100, wide=True).splitlines()) == 1


def test_the_widest_vm_report_fits_80_columns():
    """A VM's report with the guest's long text (diagnosis, task log, left stopped) fits 80 columns, nothing cut."""
    r = VmReport(200)
    r.outcome, r.exit_code, r.left_stopped, r.vm_state = VmOutcome.NOT_VERIFIED, 4, True, "stopped"
    guest_text = "nvidia-smi in VM 200 failed: " + "NVIDIA-SMI has failed because it couldn't communicate with the driver " * 2
    r.diagnosis = [(guest_text, "`qm guest exec 200 -- nvidia-smi`: is the driver loaded in the guest? " * 2)]
    r.task_log = ["TASK ERROR: " + "x" * 200]
    r.interrupted = {"signal": "SIGTERM", "action": "finished the reboot before exiting", "vm_state": "stopped", "left_stopped": True}
    text = vm_human(r)
    assert _width(text) <= 80, text
    assert " ".join(guest_text.split()) in " ".join(text.split()) and "x" * 60 in text.replace("\n      ", "")


def test_demo_output_fits_80_columns():
    """`pvegpu demo` (its audits, resets with a respawning supervisor and a restart, the summary) fits 80 columns."""
    r = _pvegpu("demo")
    assert r.returncode == 0, r.stderr
    assert _width(r.stdout) <= 80, "\n".join(line for line in r.stdout.splitlines() if len(line) > 80)
