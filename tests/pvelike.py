"""Builders for PVE-like things on a real host: an /etc/pve tree, a launcher for the hookscript,
and containers made of a cgroup under /lxc/<vmid>/ns plus a PID namespace (what a CT is from the host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PVE_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"


def etc_pve(root: str, node: str, cts: dict[int, str], vms: tuple[int, ...] = ()) -> str:
    """A pmxcfs-like tree: .vmlist, local -> nodes/<node>, nodes/<node>/lxc/<vmid>.conf."""
    os.makedirs(os.path.join(root, "nodes", node, "lxc"), exist_ok=True)
    os.makedirs(os.path.join(root, "nodes", node, "qemu-server"), exist_ok=True)
    ids = {str(v): {"node": node, "type": "lxc", "version": 1} for v in cts}
    ids.update({str(v): {"node": node, "type": "qemu", "version": 1} for v in vms})
    with open(os.path.join(root, ".vmlist"), "w") as f:
        json.dump({"version": 1, "ids": ids}, f)
    if not os.path.lexists(os.path.join(root, "local")):
        os.symlink(f"nodes/{node}", os.path.join(root, "local"))
    for vmid, text in cts.items():
        with open(os.path.join(root, "nodes", node, "lxc", f"{vmid}.conf"), "w") as f:
            f.write(text)
    return root


def launcher(dirpath: str) -> str:
    """An absolute-path ``pvegpu`` for hookscripts (PVE's PATH lacks /usr/local/bin)."""
    path = os.path.join(dirpath, "pvegpu")
    with open(path, "w") as f:
        f.write(f"#!{sys.executable} -I\nimport sys\nsys.path.insert(0, {REPO!r})\nfrom pvegpu.__main__ import main\nmain()\n")
    os.chmod(path, 0o755)
    return path


def guard(dirpath: str, pvegpu_bin: str) -> str:
    """contrib/hookscripts/pvegpu-guard with its PVEGPU path set, as `hook install` does."""
    from pvegpu.install import guard_text

    with open(os.path.join(REPO, "contrib", "hookscripts", "pvegpu-guard")) as f:
        text = guard_text(f.read(), pvegpu_bin)
    path = os.path.join(dirpath, "pvegpu-guard")
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


def run_as_pve(script: str, vmid: int, phase: str, extra_env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run a hookscript exactly as PVE does: argv, PATH, LC_ALL=C, stdin /dev/null."""
    env = {"PATH": PVE_PATH, "LC_ALL": "C"} | extra_env
    return subprocess.run([script, str(vmid), phase], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=timeout)


CLAIMS = "/run/pvegpu-test-ct"  # one O_EXCL file per container id a test run is using


def claim_vmids(n: int) -> list[int]:
    """``n`` container ids no other test run on this machine is using (claimed with O_EXCL files, and with no
    LXC container or cgroup of that name left over), so concurrent runs never share a container."""
    import random

    os.makedirs(CLAIMS, exist_ok=True)
    got: list[int] = []
    rng = random.SystemRandom()
    while len(got) < n:
        vmid = rng.randrange(900_000, 999_000)
        if os.path.exists(f"/var/lib/lxc/{vmid}") or any(os.path.exists(f"/sys/fs/cgroup/{k}/{vmid}") for k in ("lxc", "lxc.monitor")):
            continue
        try:
            os.close(os.open(os.path.join(CLAIMS, str(vmid)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            continue
        got.append(vmid)
    return got


def release_vmid(vmid: int) -> None:
    try:
        os.unlink(os.path.join(CLAIMS, str(vmid)))
    except FileNotFoundError:
        pass


def cgroup_dir(vmid: int) -> str:
    """The payload cgroup of CT vmid, as PVE lays it out (v2, or the unified hierarchy of a hybrid host)."""
    base = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"
    return os.path.join(base, "lxc", str(vmid), "ns")


def start_ct(vmid: int, argv: list[str]) -> subprocess.Popen[bytes]:
    """A PVE-like container: cgroup /lxc/<vmid>/ns, new PID+mount namespace, a stand-in init as PID 1."""
    cg = cgroup_dir(vmid)
    os.makedirs(cg, exist_ok=True)

    def enter() -> None:
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", '"$@" & exec sleep 86400', "sh", *argv],
                            preexec_fn=enter, start_new_session=True, stdin=subprocess.DEVNULL)


def ct_procs(vmid: int) -> list[int]:
    out: list[int] = []
    for dirpath, _d, _f in os.walk(os.path.dirname(cgroup_dir(vmid))):
        try:
            with open(os.path.join(dirpath, "cgroup.procs")) as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def destroy_ct(vmid: int) -> None:
    """Stop the container: SIGKILL every process of its cgroup, then remove the cgroups."""
    for _ in range(100):
        pids = ct_procs(vmid)
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    top = os.path.dirname(cgroup_dir(vmid))
    for dirpath, _d, _f in sorted(os.walk(top), key=lambda t: -len(t[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass
