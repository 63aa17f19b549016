"""Wall time of the whole start-gate hookscript process vs `nvidia-smi --query-gpu=...` in the same run.

Usage (root, on a GPU node): python3 bench/bench_gate.py [N]
Prints the medians and the ratio; the hook is run exactly as PVE runs it (argv, PATH, LC_ALL=C, stdin /dev/null)
against a PVE-like /etc/pve tree for one container granted GPU 0 (a clean start). Twice: with the settings named by
PVEGPU_CONFIG (the TOML parsed each time), and, when /etc/pvegpu/pvegpu.toml does not exist yet, with the settings
there, as an installed node has them (the root-only snapshot in /run/pvegpu spares the TOML parse); that file is
removed again at the end.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pvegpu.contract import dumps  # noqa: E402
from tests import pvelike  # noqa: E402


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    t = time.perf_counter()
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    return time.perf_counter() - t, p.returncode


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    tmp = tempfile.mkdtemp()
    conf = "arch: amd64\ndev0: /dev/nvidia0,gid=44\ndev1: /dev/nvidiactl,gid=44\nhostname: bench\n"
    root = pvelike.etc_pve(os.path.join(tmp, "pve"), "bench", {129: conf})
    cfg = os.path.join(tmp, "pvegpu.toml")
    with open(cfg, "w") as f:
        f.write(f'pve_root = "{root}"\n')
    guard = pvelike.guard(tmp, pvelike.launcher(tmp))
    env = {"PATH": pvelike.PVE_PATH, "LC_ALL": "C", "PVEGPU_CONFIG": cfg}
    smi = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
    hook = [guard, "129", "pre-start"]
    default = "/etc/pvegpu/pvegpu.toml"
    made_default = not os.path.exists(default) and os.geteuid() == 0
    if made_default:
        os.makedirs(os.path.dirname(default), exist_ok=True)
        with open(default, "w") as f:
            f.write(f'pve_root = "{root}"\n')
        os.chmod(default, 0o644)
        time.sleep(2.1)  # a file changed in the last 2 s gets no snapshot (adapters/settingsfile)
    env_default = {k: v for k, v in env.items() if k != "PVEGPU_CONFIG"}
    for argv, e in ((smi, env), (hook, env), (hook, env_default)):  # warm caches (and write the snapshot)
        timed(argv, e)
    s, h, hd = [], [], []
    try:
        for _ in range(n):  # interleaved, so all see the same machine state
            s.append(timed(smi, env)[0])
            dt, rc = timed(hook, env)
            assert rc == 0, f"hook refused a clean start (exit {rc})"
            h.append(dt)
            if made_default:
                dt, rc = timed(hook, env_default)
                assert rc == 0, f"hook refused a clean start with {default} (exit {rc})"
                hd.append(dt)
    finally:
        if made_default:
            os.unlink(default)
    res = {"runs": n, "nvidia_smi_median_ms": round(statistics.median(s) * 1000, 1),
           "hook_median_ms": round(statistics.median(h) * 1000, 1),
           "ratio": round(statistics.median(h) / statistics.median(s), 2),
           "hook_p90_ms": round(sorted(h)[int(0.9 * n) - 1] * 1000, 1), "nvidia_smi_p90_ms": round(sorted(s)[int(0.9 * n) - 1] * 1000, 1)}
    if hd:
        res["hook_default_file_median_ms"] = round(statistics.median(hd) * 1000, 1)
        res["ratio_default_file"] = round(statistics.median(hd) / statistics.median(s), 2)
    py = sys.executable
    parts = {"python -I -c pass": [py, "-I", "-c", "pass"],
             "python -I -S -c pass": [py, "-I", "-S", "-c", "pass"],
             "python -I: import pynvml + nvmlInit": [py, "-I", "-c", "import pynvml; pynvml.nvmlInit()"],
             "python -I: import pvegpu.hook": [py, "-I", "-c", f"import sys; sys.path.insert(0, {pvelike.REPO!r}); import pvegpu.hook"]}
    for label, argv in parts.items():
        res[label + " (median ms)"] = round(statistics.median(timed(argv, env)[0] for _ in range(10)) * 1000, 1)
    lines = [ln for ln in open(guard).read().splitlines() if ln.startswith(("PVEGPU_PYTHON=", "PVEGPU_PYTHONPATH="))]
    fast = dict(ln.split("=", 1) for ln in lines)
    if fast.get("PVEGPU_PYTHON"):
        code = "import sys; sys.path[:0] = sys.argv.pop(1).split(':'); from pvegpu.__main__ import main; main()"
        p = subprocess.run([fast["PVEGPU_PYTHON"], "-X", "importtime", "-I", "-S", "-c", code, fast["PVEGPU_PYTHONPATH"], "hook", "129", "pre-start"],
                           capture_output=True, text=True, env=env)
        top = sorted((ln for ln in p.stderr.splitlines() if ln.startswith("import time:") and ln.split("|")[1].strip().isdigit()),
                     key=lambda ln: -int(ln.split("|")[1]))[:8]
        res["hook imports (cumulative us, top)"] = [" ".join(t.split()) for t in top]
    print(dumps(res))


if __name__ == "__main__":
    main()
