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
from pvegpu import hook  # noqa: E402
from pvegpu.settings import load  # noqa: E402

mark("import pvegpu.hook")
s = load(env={"PVEGPU_PVE_ROOT": root})
mark("settings")
pve, probe, host = hook._ports(s)
mark("ports (NvmlLite init = nvmlInit)")
guest = hook.find_guest(129, pve)
conf = hook.parse_config(pve.ct_config(guest))
mark("find guest + parse config")
gpus = list(hook.granted_gpus(conf, probe.gpus())[0])
mark("gpus()")
pids = host.ct_pids(129)
mark("ct_pids")
facts = hook.inspect_gpus(129, gpus, host=host, probe=probe, ct_pids=pids)
mark("inspect (sample + scan)")
d = hook.decide(129, facts, pids, hook.GatePolicy())
mark("decide")
prev = marks[0][1]
for label, t in marks[1:]:
    print(f"{label:40s} {1000 * (t - prev):7.2f} ms")
    prev = t
print(f"{'total after setup':40s} {1000 * (marks[-1][1] - marks[0][1]):7.2f} ms   allow={d.allow}")
