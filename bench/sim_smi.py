"""``nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits`` for a simulated node (no GPU here).

    python3 bench/sim_smi.py DIR

Reads the node's simulated NVML (``pvegpu.sim.nvml``, the same driver model every pvegpu process of that node reads:
memory comes back a release latency after the last holder died) and prints one ``index, used MiB`` line per GPU, as
nvidia-smi does. The manual routine of bench/reset.py ends with it on a simulated node; the reset's floor polls
``used_mib`` in its own process.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pvegpu.sim.nvml import SimNvml  # noqa: E402
from pvegpu.sim.state import SimState  # noqa: E402

MIB = 1 << 20


def used_mib(root: str) -> dict[int, float | None]:
    """index → memory used (MiB) of every GPU of the simulated node in ``root``; None: that GPU cannot be read."""
    nvml = SimNvml(SimState(root))
    gpus = nvml.gpus()
    samples = nvml.sample([g.minor for g in gpus])
    return {g.index: None if samples[g.minor].used_bytes is None else samples[g.minor].used_bytes / MIB for g in gpus}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: sim_smi.py DIR", file=sys.stderr)
        return 2
    for index, used in sorted(used_mib(argv[0]).items()):
        print(f"{index}, {'[N/A]' if used is None else round(used)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
