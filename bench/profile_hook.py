"""Where the start gate's time goes, phase by phase (run as root on a GPU node): python3 bench/profile_hook.py"""

from __future__ import annotations

import time

T0 = time.perf_counter()
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import pvelike  # noqa: E402

marks: list[tuple[str, float]] = []


def mark(label: str) -> None:
    marks.append((label, time.perf_counter()))


tmp = tempfile.mkdtemp()
root = pvelike.etc_pve(os.path.join(tmp, "pve"), "bench", {129: "dev0: /dev/nvidia0,gid=44\n"})
mark("setup")
from pvegpu import gate, hook, wiring  # noqa: E402,F401
from pvegpu.adapters.settingsfile import load  # noqa: E402
from pvegpu.holders import inspect_gpus  # noqa: E402
from pvegpu.locate import find_guest, granted_gpus  # noqa: E402
from pvegpu.lxcconf import parse_config  # noqa: E402

mark("import pvegpu.hook")
s = load(env={"PVEGPU_PVE_ROOT": root})
mark("settings")
ports = wiring.gate_ports(s)
mark("ports (NVML's start begun in its thread)")
guest = find_guest(129, ports.pve)
conf = parse_config(ports.pve.ct_config(guest))
mark("find guest + parse config")
gpus = list(granted_gpus(conf, ports.probe.gpus())[0])
mark("gpus()")
pids = ports.host.ct_pids(129)
mark("ct_pids")
facts = inspect_gpus(129, gpus, host=ports.host, probe=ports.probe, ct_pids=pids)
mark("inspect (sample + scan)")
d = gate.decide(129, facts, gate.Situation(tuple(pids)), wiring.gate_policy(s))
mark("decide")
prev = marks[0][1]
for label, t in marks[1:]:
    print(f"{label:40s} {1000 * (t - prev):7.2f} ms")
    prev = t
print(f"{'total after setup':40s} {1000 * (marks[-1][1] - marks[0][1]):7.2f} ms   allow={d.allow}")
