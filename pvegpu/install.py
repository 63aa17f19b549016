"""Render the guard hookscript with this installation's paths (used by `pvegpu hook install` and tests)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys


def guard_text(template: str, pvegpu_bin: str | None = None, fast: bool = True) -> str:
    """The guard with PVEGPU set to an absolute path and, if ``fast``, the -S fast path filled in."""
    pvegpu_bin = pvegpu_bin or shutil.which("pvegpu") or "/usr/local/bin/pvegpu"
    text = template.replace("PVEGPU=/usr/local/bin/pvegpu", f"PVEGPU={pvegpu_bin}")
    if fast:
        paths = []
        for mod in ("pvegpu", "pynvml"):
            spec = importlib.util.find_spec(mod)
            if spec and spec.origin:
                origin = os.path.dirname(spec.origin)
                paths.append(os.path.dirname(origin) if mod == "pvegpu" else origin)
        text = text.replace("PVEGPU_PYTHON=\n", f"PVEGPU_PYTHON={sys.executable}\n")
        text = text.replace("PVEGPU_PYTHONPATH=\n", f"PVEGPU_PYTHONPATH={':'.join(dict.fromkeys(paths))}\n")
    return text
