"""On the GPU machine: a real CUDA holder inside the namespace "guest" (real qemu-ga, the host's real nvidia-smi on
its PATH) is stopped by `pvegpu reset 200` through fakepve's agent endpoints, and the memory is verified back
through the guest's nvidia-smi. Marker ``gpu``; skipped without NVML, torch or qemu-ga. PVEGPU_RESULTS=<file>
appends the wall time (BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest
from fakepve import agent as fake_agent

from tests.test_faults import cli, write_config
from tests.test_gpu import _nvml_ok, _used_mib, _wait_used
from tests.vm_guest import QEMU_GA, Guest, forwarder


def _torch() -> bool:
    try:
        import torch  # noqa: F401

        return True
    except Exception:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _nvml_ok(), reason="no NVIDIA GPU/NVML here (runs on the device machine)"),
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(QEMU_GA) or not shutil.which("nvidia-smi") or not _torch(),
                       reason="needs root, qemu-ga, nvidia-smi and torch"),
]

CUDA = ("import torch, time\nx = torch.empty(2 << 30, dtype=torch.uint8, device='cuda'); x.fill_(1); torch.cuda.synchronize()\n"
        "time.sleep(3600)\n")


def test_cuda_holder_in_the_guest_stopped_and_verified_through_its_nvidia_smi(fakepve, fakepve_cafile, tmp_path, monkeypatch, request):
    """2 GiB of real CUDA memory held inside the guest: found, SIGTERMed, verified clean by the guest's nvidia-smi, exit 0; NVML agrees."""
    base = _used_mib()
    fakepve.apitokens["root@pam!pvegpu"] = "a1b2"
    v = fakepve.add_vm(200, "gpu200", node="pve1", status="running", config={"hostpci0": "0000:01:00.0", "agent": "1", "ostype": "l26"})
    v.agent = {}
    guest = Guest(str(tmp_path / "guest"), real_gpu=True)
    request.addfinalizer(guest.stop)
    monkeypatch.setattr(fake_agent, "result", forwarder(guest, 200, fake_agent.result))
    (tmp_path / "cuda.py").write_text(CUDA)
    guest.spawn(sys.executable, str(tmp_path / "cuda.py"))
    _wait_used(base + 2000)
    host, port = fakepve.url.split("//")[1].split(":")
    tok = tmp_path / "token"
    tok.write_text("a1b2\n")
    tok.chmod(0o600)
    cfg = write_config(tmp_path / "pvegpu.toml", top={"node": "pve1", "pve_root": str(tmp_path / "none")},
                       api=dict(backend="https", host=host, port=int(port), token_name="pvegpu", token_file=str(tok),
                                verify=fakepve_cafile, timeout=10),
                       reset={"grace": 5, "timeout": 30, "lock_dir": str(tmp_path / "lock"), "restart": False})
    t0 = time.monotonic()
    r = cli(["reset", "200", "--json"], config=cfg, module="pvegpu", bound=120)
    wall = time.monotonic() - t0
    rep = r.report
    assert r.rc == 0 and rep["outcome"] == "clean" and rep["evidence"] == "guest", r.err + r.out
    assert rep["before"]["holders"] and rep["after"]["holders"] == []
    assert _used_mib() < base + 256
    if os.environ.get("PVEGPU_RESULTS"):
        with open(os.environ["PVEGPU_RESULTS"], "a") as f:
            f.write(json.dumps({"scenario": "vm: CUDA holder in the guest (qemu-ga), verified by the guest's nvidia-smi",
                                "outcome": rep["outcome"], "exit": r.rc, "wall_s": round(rep["elapsed_s"], 3),
                                "cli_wall_s": round(wall, 3)}) + "\n")
