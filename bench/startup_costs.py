"""What a ``pvegpu reset`` process pays before it can read NVML: interpreter start, imports, NVML init,
next to ``nvidia-smi`` (median of N whole processes each). Run on the GPU node from the repo root:

    python3 bench/startup_costs.py [N]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
CASES = {
    "python3 -I -S -c pass": [PY, "-I", "-S", "-c", "pass"],
    "python3 -c pass": [PY, "-c", "pass"],
    "import structlog": [PY, "-c", "import structlog"],
    "import typer": [PY, "-c", "import typer"],
    "import proxmoxer": [PY, "-c", "import proxmoxer"],
    "import pynvml; nvmlInit()": [PY, "-c", "import pynvml; pynvml.nvmlInit()"],
    "ctypes nvmlInit_v2 (-I -S)": [PY, "-I", "-S", "-c", "import ctypes; ctypes.CDLL('libnvidia-ml.so.1').nvmlInit_v2()"],
    "import pvegpu.cli": [PY, "-c", "import pvegpu.cli"],
    "import pvegpu.cli + pvegpu.logs": [PY, "-c", "import pvegpu.cli, pvegpu.logs"],
    "python3 -m pvegpu --help": [PY, "-m", "pvegpu", "--help"],
    "nvidia-smi --query-gpu=index,memory.used": ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
}


def median_ms(argv: list[str], n: int) -> float:
    env = dict(os.environ, PYTHONPATH=REPO)
    subprocess.run(argv, capture_output=True, env=env)  # warm the page cache
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(argv, capture_output=True, env=env)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1000


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    for name, argv in CASES.items():
        print(f"{name:45s} {median_ms(argv, n):7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
