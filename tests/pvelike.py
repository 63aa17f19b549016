"""Builders for PVE-like things on a real host: an /etc/pve tree, a launcher for the hookscript,
and containers made of a cgroup under /lxc/<vmid>/ns plus a PID namespace (what a CT is from the host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

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
    from pvegpu.cli.install import guard_text

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


def kill_and_reap(*pids: int) -> None:
    """SIGKILL and reap children a test left behind (any already gone or reaped is skipped)."""
    for p in pids:
        try:
            os.kill(p, 9)
            os.waitpid(p, 0)
        except (ProcessLookupError, ChildProcessError):
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
    """Host pids of every process in CT vmid's cgroups."""
    return cgroup_procs(os.path.dirname(cgroup_dir(vmid)))


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
    remove_cgroup_tree(os.path.dirname(cgroup_dir(vmid)))


def remove_cgroup_tree(top: str) -> None:
    """``rmdir`` every cgroup below ``top``, deepest first, then ``top``: by directory fd, so a tree a test nested past
    PATH_MAX goes too (a path-based walk fails there and leaves it behind for every later run)."""
    if not os.path.isdir(top):
        return
    for _path, dirs, _files, dirfd in os.fwalk(top, topdown=False):
        for d in dirs:
            try:
                os.rmdir(d, dir_fd=dirfd)
            except OSError:
                pass
    try:
        os.rmdir(top)
    except OSError:
        pass


# -- generated process trees (tests/test_safety_property.py) ---------------------------------------------
#
# One launcher process, started by ``grow_world``, forks a whole node from a JSON spec: per container an
# lxc-start-like monitor in lxc.monitor/<vmid>, which makes a new PID namespace whose PID 1 (the stand-in
# init) enters /lxc/<vmid>/ns and forks the payload; host processes in a private host cgroup. Every
# process reports its host pid, start ticks and NSpid in <ready>/<id> once it is in place, so the test
# knows each process by identity without trusting pvegpu's reading of /proc. Forks, not new interpreters:
# a tree of 20 processes is in place in a few tens of milliseconds.

CLONE_NEWPID = 0x20000000


def cgroup_base() -> str:
    """The hierarchy PVE's container cgroups live in (v2 root, or the unified hierarchy of a hybrid host)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(cgroup_dir(0))))


def monitor_dir(vmid: int) -> str:
    """The cgroup of CT vmid's lxc-start monitor, as PVE lays it out."""
    return os.path.join(cgroup_base(), "lxc.monitor", str(vmid))


def kill_cgroup(top: str, timeout: float = 10.0) -> bool:
    """SIGKILL every process under cgroup dir ``top`` (cgroup.kill where the kernel has it), wait until it is
    empty, remove the dirs deepest first. False when something was still there at the deadline."""
    if not os.path.isdir(top):
        return True
    try:
        with open(os.path.join(top, "cgroup.kill"), "w") as f:
            f.write("1")
    except OSError:
        pass
    deadline = time.monotonic() + timeout
    while True:
        pids = cgroup_procs(top)
        for p in pids:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
        if not pids or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    for dirpath, _d, _f in sorted(os.walk(top), key=lambda t: -len(t[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass
    return not os.path.isdir(top)


def cgroup_procs(top: str) -> list[int]:
    """Host pids in the cgroup ``top`` and every cgroup below it (``cat .../cgroup.procs``)."""
    out: list[int] = []
    for dirpath, _d, _f in os.walk(top):
        try:
            with open(os.path.join(dirpath, "cgroup.procs")) as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def grow_world(spec: dict, workdir: str) -> subprocess.Popen[bytes]:
    """Start the launcher for ``spec`` (see ``_grow``) in spec["host_cgroup"]; its stderr goes to workdir/agent.log.

    spec: {"dev": path, "ready": dir, "go": path, "host_cgroup": dir, "launcher": id,
           "cts": [{"vmid", "init", "monitor", "init_holds", "monitor_holds", "procs": [node]}], "host": [node]}
    node: {"id", "hold", "ignore_term", "exit_after" (None, or seconds after the go file appears),
           "orphan" (its parent exits at once: re-parented), "nested_ns" (PID 1 of a new PID namespace made by
           a shim process "<id>.shim"), "cgroup" (None, or a path under the container's ns/), "children": [node]}
    """
    path = os.path.join(workdir, "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    host_cg = spec["host_cgroup"]

    def enter() -> None:
        with open(os.path.join(host_cg, "cgroup.procs"), "w") as f:
            f.write("0")

    code = f"import sys; sys.path.insert(0, {REPO!r}); from tests.pvelike import _grow; _grow(sys.argv[1])"
    with open(os.path.join(workdir, "agent.log"), "wb") as log:
        return subprocess.Popen([sys.executable, "-I", "-c", code, path], preexec_fn=enter, start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def wait_ready(ready_dir: str, ids: set[str], launcher: subprocess.Popen[bytes], timeout: float = 30.0) -> dict[str, dict]:
    """Each id's report {"pid", "start", "nspid"} once all are in place; AssertionError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        have = set(os.listdir(ready_dir))
        if ids <= have:
            break
        if launcher.poll() is not None or time.monotonic() >= deadline:
            raise AssertionError(f"process tree not in place (launcher rc {launcher.poll()}); missing {sorted(ids - have)}")
        time.sleep(0.01)
    out = {}
    for i in ids:
        with open(os.path.join(ready_dir, i)) as f:
            out[i] = json.load(f)
    return out


# -- the launcher's side (runs in the forked processes; stdlib only) ----------------------------------


def _grow(spec_path: str) -> None:
    import signal

    with open(spec_path) as f:
        spec = json.load(f)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # inherited: every parent, init and nested init reaps at once
    _report(spec, spec["launcher"])
    for ct in spec["cts"]:
        _fork(_monitor, spec, ct)
    for node in spec["host"]:
        _child(spec, None, node, None)
    _forever()


def _forever() -> None:
    while True:
        time.sleep(3600)


def _fork(fn: Callable[..., object], *args: object) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid


def _unshare_pid() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _enter_cgroup(path: str) -> None:
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write("0")


def _report(spec: dict, ident: str) -> None:
    """Write ready/<id>: host pid and start ticks (read through the host's /proc), and NSpid."""
    with open("/proc/self/comm", "w") as f:
        f.write(f"pt-{ident}"[:15])
    with open("/proc/self/stat") as f:
        text = f.read()
    fields = text[text.rfind(")") + 2 :].split()
    with open("/proc/self/status") as f:
        nspid = [int(x) for line in f if line.startswith("NSpid:") for x in line.split()[1:]]
    tmp = os.path.join(spec["ready"], f".{ident}")
    with open(tmp, "w") as f:
        json.dump({"pid": int(text.split()[0]), "start": int(fields[19]), "nspid": nspid}, f)
    os.rename(tmp, os.path.join(spec["ready"], ident))


def _device(spec: dict, fd: int | None, hold: bool) -> int | None:
    """Keep an inherited device fd (a fork-inherited holder), open one, or drop it."""
    if hold:
        return fd if fd is not None else os.open(spec["dev"], os.O_RDWR | os.O_NOCTTY)
    if fd is not None:
        os.close(fd)
    return None


def _monitor(spec: dict, ct: dict) -> None:
    _enter_cgroup(monitor_dir(ct["vmid"]))
    fd = _device(spec, None, ct["monitor_holds"])
    _report(spec, ct["monitor"])
    _unshare_pid()
    _fork(_init, spec, ct, fd)
    _forever()


def _init(spec: dict, ct: dict, fd: int | None) -> None:
    _enter_cgroup(cgroup_dir(ct["vmid"]))
    fd = _device(spec, fd, ct["init_holds"])
    _report(spec, ct["init"])
    for node in ct["procs"]:
        _child(spec, ct, node, fd)
    _forever()


def _child(spec: dict, ct: dict | None, node: dict, fd: int | None) -> None:
    """Fork one node the way the spec says: plainly, as an orphan, or as PID 1 of a new PID namespace."""
    if node["nested_ns"]:
        _fork(_shim, spec, ct, node, fd)
    elif node["orphan"]:
        _fork(_orphan_parent, spec, ct, node, fd)
    else:
        _fork(_node, spec, ct, node, fd, None)


def _shim(spec: dict, ct: dict | None, node: dict, fd: int | None) -> None:
    """What a container runtime's shim does: unshare a PID namespace, fork its PID 1, stay around."""
    _report(spec, node["id"] + ".shim")
    _unshare_pid()
    _fork(_node, spec, ct, node, fd, None)
    _device(spec, fd, False)
    _forever()


def _orphan_parent(spec: dict, ct: dict | None, node: dict, fd: int | None) -> None:
    _fork(_node, spec, ct, node, fd, os.getpid())
    # returning exits at once: the node is re-parented to the namespace's init (or the host's subreaper)


def _node(spec: dict, ct: dict | None, node: dict, fd: int | None, orphan_of: int | None) -> None:
    import signal

    if orphan_of is not None:
        end = time.monotonic() + 10
        while os.getppid() == orphan_of and time.monotonic() < end:
            time.sleep(0.002)
    if ct is not None and node["cgroup"]:
        _enter_cgroup(os.path.join(cgroup_dir(ct["vmid"]), node["cgroup"]))
    signal.signal(signal.SIGTERM, signal.SIG_IGN if node["ignore_term"] else signal.SIG_DFL)
    fd = _device(spec, fd, node["hold"])
    for child in node["children"]:
        _child(spec, ct, child, fd)
    _report(spec, node["id"])
    if node["exit_after"] is None:
        _forever()
    end = time.monotonic() + 60
    while not os.path.exists(spec["go"]) and time.monotonic() < end:
        time.sleep(0.005)
    time.sleep(node["exit_after"])


def as_uid(uid: int, act: Callable[[], object]) -> None:
    """Run ``act()`` in a forked child as an unprivileged uid (gid the same, no groups): a local user, the
    exporter's user. Fails the test if ``act`` raises."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            act()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def wait_until(cond: Callable[[], object], what: str, limit: float = 10.0) -> object:
    """What ``cond()`` returns once it is truthy, polled every 20 ms; fails the test after ``limit`` seconds."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if got := cond():
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def high_pty(min_index: int = 64, tries: int = 256) -> tuple[int, int]:
    """A pty pair (master, slave) with a high index, as a private stand-in device nobody else holds. Every devpts
    instance (each LXC container mounts its own) numbers its ptys from 0 with the same device numbers, so a low
    index is likely also some container's console, held by its lxc-start; the host instance's high ones are free."""
    pairs = [os.openpty()]
    while int(os.ttyname(pairs[-1][1]).rsplit("/", 1)[1]) < min_index and len(pairs) < tries:
        pairs.append(os.openpty())
    for fd in (fd for pair in pairs[:-1] for fd in pair):
        os.close(fd)
    return pairs[-1]


def private_device() -> tuple[int, str, int]:
    """(master fd, slave path, device number) of a ``high_pty()``: a stand-in GPU device of this run only. The
    slave is closed (the caller must not hold the GPU itself); keep the master open while it is used; open the
    slave with O_NOCTTY (a session leader would take it as its terminal)."""
    master, slave = high_pty()
    path, rdev = os.ttyname(slave), os.fstat(slave).st_rdev
    os.close(slave)
    return master, path, rdev
