"""The Proxmox adapter: error mapping with `responses`, and real HTTPS against fakepve (token auth, tasks, knobs)."""

from __future__ import annotations

import os

import pytest
import requests
import responses
from proxmoxer import ProxmoxAPI

from pvegpu.adapters.pve import ProxmoxerPve, read_token
from pvegpu.core.errors import ConfigError, PveApiError, TaskFailed, TaskTimeout
from pvegpu.core.model import Guest

BASE = "https://pve.test:8006/api2/json"
G = Guest(129, "pve1", "lxc")


def offline_api():
    return ProxmoxerPve(ProxmoxAPI("pve.test", user="root@pam", token_name="t", token_value="s", verify_ssl=True), node="pve1")


@responses.activate
@pytest.mark.parametrize("status,hint", [(401, "API token"), (403, "VM.PowerMgmt"), (500, "task log")])
def test_http_errors_mapped_with_hint(status, hint):
    """HTTP errors become PveApiError with the status, PVE's text and a hint."""
    responses.add(responses.POST, f"{BASE}/nodes/pve1/lxc/129/status/stop", status=status, body="nope")
    with pytest.raises(PveApiError) as exc:
        offline_api().ct_stop(G)
    assert str(status) in exc.value.message and hint in exc.value.hint


@responses.activate
def test_connection_error_mapped():
    """A refused connection is a PveApiError naming host:port and the cause, not a requests traceback."""
    responses.add(responses.GET, f"{BASE}/cluster/resources", body=requests.ConnectionError("[Errno 111] Connection refused"))
    with pytest.raises(PveApiError, match="list guests: connection to pve.test:8006 refused") as exc:
        offline_api().guests()
    assert "pveproxy" in exc.value.hint and "certificate" not in exc.value.hint


@responses.activate
def test_status_parsing_ha_and_lock():
    """status/current: HA-managed and lock are read."""
    responses.add(responses.GET, f"{BASE}/nodes/pve1/lxc/129/status/current",
                  json={"data": {"status": "running", "ha": {"managed": 1}, "lock": "backup"}})
    st = offline_api().ct_status(G)
    assert (st.status, st.ha_managed, st.lock) == ("running", True, "backup")


def test_token_file_must_be_private(tmp_path):
    """A token file readable by others is refused."""
    f = tmp_path / "tok"
    f.write_text("abc\n")
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        read_token(str(f))
    f.chmod(0o600)
    assert read_token(str(f)) == "abc"


@pytest.fixture
def pve(fakepve, fakepve_cafile):
    fakepve.apitokens["root@pam!pvegpu"] = "a1b2"
    fakepve.ct129 = fakepve.add_ct(129, "llm129", node="pve1", status="running", config={"dev0": "/dev/nvidia0,gid=44"})
    host, port = fakepve.url.split("//")[1].split(":")
    api = ProxmoxAPI(host, port=int(port), user="root@pam", token_name="pvegpu", token_value="a1b2", verify_ssl=fakepve_cafile, timeout=10)
    return fakepve, ProxmoxerPve(api, node="pve1")


def wait(adapter, upid, what, task_timeout=10.0):
    return adapter.wait_task("pve1", upid, timeout=task_timeout, what=f"{what} task of CT 129")


def test_token_auth_config_and_stop_start_tasks(pve):
    """Over real HTTPS with a verified certificate and a token: locate, read config, stop and start tasks end OK."""
    fake, a = pve
    assert a.where(129) == Guest(129, "pve1", "lxc", "llm129")
    assert a.ct_config(G)["dev0"] == "/dev/nvidia0,gid=44"
    assert wait(a, a.ct_stop(G), "stop").exitstatus == "OK"
    assert a.ct_status(G).status == "stopped"
    wait(a, a.ct_start(G), "start")
    assert a.ct_status(G).status == "running"


def test_bad_token_is_auth_error(pve, fakepve_cafile):
    """A wrong token secret gives a PveApiError with the token hint."""
    fake, a = pve
    fake.apitokens["root@pam!pvegpu"] = "other"
    with pytest.raises(PveApiError) as exc:
        a.guests()
    assert "401" in exc.value.message


def test_not_running_and_locked(pve):
    """Stopping a stopped CT and starting a locked one are PveApiErrors with PVE's wording."""
    fake, a = pve
    wait(a, a.ct_stop(G), "stop")
    with pytest.raises(PveApiError, match="not running"):
        a.ct_stop(G)
    fake.ct129.lock = "backup"
    with pytest.raises(PveApiError, match="locked"):  # at the POST, or as the task's failure
        wait(a, a.ct_start(G), "start")


def test_did_not_stop_task_failure(pve):
    """A stop task that fails inside PVE (did_not_stop) is a TaskFailed carrying PVE's message."""
    fake, a = pve
    fake.fail("POST", "/nodes/pve1/lxc/129/status/stop", error="did_not_stop")
    with pytest.raises((TaskFailed, PveApiError)):
        wait(a, a.ct_stop(G), "stop")


def test_start_error_hookscript_refusal_reported(pve):
    """A start whose task ends with the guard's refusal is reported as that refusal, with the check hint."""
    fake, a = pve
    wait(a, a.ct_stop(G), "stop")
    fake.ct129.start_error = "hookscript error for 129 on pre-start: command '/var/lib/vz/snippets/pvegpu-guard 129 pre-start' failed: exit code 10"
    with pytest.raises(TaskFailed) as exc:
        wait(a, a.ct_start(G), "start")
    assert "hookscript error for 129 on pre-start" in exc.value.message and "pvegpu check 129" in exc.value.hint
    assert any("hookscript error for 129" in line for line in exc.value.log_tail)  # the task log's tail travels with it


def test_node_pve_without_api_cannot_wait_for_a_task():
    """NodePve with only /etc/pve refuses to wait for a task with the 'no API' error, not a traceback."""
    from pvegpu.adapters.etcpve import NodePve

    with pytest.raises(PveApiError, match="needs the Proxmox API"):
        NodePve(None, None).wait_task("pve1", "UPID:pve1:0:0:0:vzstop:129:root@pam:", timeout=1, what="stop task of CT 129")


@pytest.mark.fakepve(time_scale=0.05)
def test_slow_task_times_out(pve):
    """A stop task slower than task_timeout raises TaskTimeout naming the UPID."""
    fake, a = pve
    fake.ct129.stop_secs = 100
    with pytest.raises(TaskTimeout, match="still running"):
        wait(a, a.ct_stop(G), "stop", task_timeout=0.5)


def _token_file(tmp_path):
    f = tmp_path / "token"
    f.write_text("a1b2\n")
    f.chmod(0o600)
    return str(f)


def test_https_connect_verifies_ca_and_pinned_fingerprint(pve, fakepve_cafile, tmp_path):
    """connect(): the CA file verifies the node; a pinned SHA-256 fingerprint works without a CA; a wrong pin
    or no CA at all is refused."""
    import hashlib
    import ssl

    from pvegpu.adapters.pve import connect
    from pvegpu.core.settings import ApiSettings

    fake, _ = pve
    host, port = fake.url.split("//")[1].split(":")
    base = dict(host=host, port=int(port), token_name="pvegpu", token_file=_token_file(tmp_path), timeout=10)
    assert ProxmoxerPve(connect(ApiSettings(**base, verify=fakepve_cafile), "https")).guests()
    der = ssl.PEM_cert_to_DER_cert(open(fakepve_cafile).read())
    fp = ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())
    assert ProxmoxerPve(connect(ApiSettings(**base, fingerprint=fp), "https")).guests()
    with pytest.raises(PveApiError, match="does not match api.fingerprint") as exc:
        ProxmoxerPve(connect(ApiSettings(**base, fingerprint="00" * 32), "https")).guests()
    assert "pvenode cert info" in exc.value.hint
    with pytest.raises(PveApiError, match=f"TLS verification of {host}:{port} failed") as exc:
        ProxmoxerPve(connect(ApiSettings(**base, verify="true"), "https")).guests()
    assert "pve-root-ca.pem" in exc.value.hint


# -- answers of the wrong shape (HTTPS, with responses) ---------------------------------------------------------

@responses.activate
@pytest.mark.parametrize("method,path,data,call", [
    ("GET", "/cluster/resources", None, lambda a: a.guests()),
    ("GET", "/cluster/resources", {"vmid": 129}, lambda a: a.guests()),
    ("GET", "/cluster/resources", [{"type": "lxc", "vmid": "abc", "node": "pve1"}], lambda a: a.guests()),
    ("GET", "/cluster/resources", ["lxc/129"], lambda a: a.guests()),
    ("GET", "/nodes/pve1/lxc/129/config", None, lambda a: a.ct_config(G)),
    ("GET", "/nodes/pve1/lxc/129/config", "dev0: /dev/nvidia0", lambda a: a.ct_config(G)),
    ("GET", "/nodes/pve1/lxc/129/status/current", None, lambda a: a.ct_status(G)),
    ("GET", "/nodes/pve1/lxc/129/status/current", {"status": 1}, lambda a: a.ct_status(G)),
    ("GET", "/nodes/pve1/lxc/129/status/current", {"status": "running", "ha": "yes"}, lambda a: a.ct_status(G)),
    ("GET", "/nodes/pve1/tasks/UPID:x/status", None, lambda a: a.task_status("pve1", "UPID:x")),
    ("GET", "/nodes/pve1/tasks/UPID:x/status", {"status": "stopped"}, lambda a: a.task_status("pve1", "UPID:x")),
    ("GET", "/nodes/pve1/tasks/UPID:x/log", {"t": "TASK OK"}, lambda a: a.task_log("pve1", "UPID:x")),
    ("GET", "/nodes/pve1/storage/local/content", None, lambda a: a.snippets("pve1", "local")),
    ("POST", "/nodes/pve1/lxc/129/status/stop", None, lambda a: a.ct_stop(G)),
    ("POST", "/nodes/pve1/lxc/129/status/start", {"errors": ""}, lambda a: a.ct_start(G)),
    ("POST", "/nodes/pve1/lxc/129/status/stop", "OK", lambda a: a.ct_stop(G)),
])
def test_malformed_answer_is_exit_4_naming_the_call(method, path, data, call):
    """data: null, a wrong type or a non-UPID task id is an exit-4 PveApiError naming the call, never a traceback."""
    responses.add(method, BASE + path, json={"data": data})
    with pytest.raises(PveApiError) as exc:
        call(offline_api())
    assert exc.value.exit_code == 4 and "unexpected answer from pve.test:8006" in exc.value.message
    assert exc.value.message.split(":")[0] in ("list guests", "read CT 129 config", "read CT 129 status", "read task status",
                                                "read task log", "list snippets on pve1", "stop CT 129", "start CT 129")


@responses.activate
def test_well_formed_answers_accepted():
    """vmid as a digit string, rows of other types skipped, a UPID with a 9-digit pstart: all accepted."""
    responses.add(responses.GET, f"{BASE}/cluster/resources", json={"data": [
        {"type": "lxc", "vmid": "129", "node": "pve1", "name": "a"}, {"type": "storage", "id": "storage/pve1/local"}]})
    upid = "UPID:pve1:0006A1F2:10B2C3D4E:66F0A1B2:vzstop:129:pvegpu@pve!t:"
    responses.add(responses.POST, f"{BASE}/nodes/pve1/lxc/129/status/stop", json={"data": upid})
    a = offline_api()
    assert a.guests() == [Guest(129, "pve1", "lxc", "a")]
    assert a.ct_stop(G) == upid


# -- transport errors: each cause with its own hint ------------------------------------------------------------

@responses.activate
@pytest.mark.parametrize("exc,cause,hint,not_hint", [
    (requests.ConnectionError("Failed to resolve 'pve.test' ([Errno -2] Name or service not known)"),
     "cannot resolve the host name of pve.test:8006", "api.host", "certificate"),
    (requests.exceptions.ReadTimeout("Read timed out. (read timeout=30)"), "pve.test:8006 did not answer within", "api.timeout", "certificate"),
    (requests.exceptions.ConnectTimeout("timed out"), "connecting to pve.test:8006 timed out", "firewall", "certificate"),
    (requests.exceptions.SSLError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"), "TLS verification of pve.test:8006 failed",
     "pve-root-ca.pem", "api.timeout"),
])
def test_transport_errors_name_target_cause_and_matching_hint(exc, cause, hint, not_hint):
    """DNS failure, read timeout, connect timeout, TLS failure: host:port, the cause, the hint for that cause only."""
    responses.add(responses.GET, f"{BASE}/cluster/resources", body=exc)
    with pytest.raises(PveApiError) as err:
        offline_api().guests()
    assert cause in err.value.message and hint in err.value.hint and not_hint not in err.value.hint


def test_missing_ca_file_is_config_error_naming_it(tmp_path):
    """api.verify pointing at a missing CA file is a ConfigError (exit 2) naming the file, not OSError."""
    ca = str(tmp_path / "no-such-ca.pem")
    a = ProxmoxerPve(ProxmoxAPI("pve.test", user="root@pam", token_name="t", token_value="s", verify_ssl=ca), node="pve1")
    with pytest.raises(ConfigError) as exc:
        a.guests()
    assert ca in exc.value.message and exc.value.exit_code == 2


def _token_api(fake, cafile, tokenid="pvegpu@pve!t", secret="s3"):
    fake.apitokens[tokenid] = secret
    user, _, name = tokenid.partition("!")
    host, port = fake.url.split("//")[1].split(":")
    return ProxmoxerPve(ProxmoxAPI(host, port=int(port), user=user, token_name=name, token_value=secret, verify_ssl=cafile, timeout=10),
                        node="pve1")


def test_403_names_missing_privilege_and_path(pve, fakepve_cafile):
    """A token with VM.Audit but not VM.PowerMgmt: the stop's 403 names VM.PowerMgmt and /vms/129."""
    fake, _ = pve
    fake.grant("pvegpu@pve!t", "/vms/129", "VM.Audit")
    a = _token_api(fake, fakepve_cafile)
    with pytest.raises(PveApiError) as exc:
        a.ct_stop(G)
    assert "lacks VM.PowerMgmt on /vms/129" in exc.value.message and "pveum acl modify /vms/129" in exc.value.hint
    assert fake.ct129.status == "running"


def test_token_without_vm_audit_is_not_a_missing_guest(pve, fakepve_cafile):
    """A token lacking VM.Audit does not see CT 129 in /cluster/resources: reported as the missing privilege (exit 4)."""
    fake, _ = pve
    fake.grant("pvegpu@pve!t", "/nodes", "Sys.Audit")
    with pytest.raises(PveApiError) as exc:
        _token_api(fake, fakepve_cafile).where(129)
    assert "lacks VM.Audit on /vms/129" in exc.value.message and exc.value.exit_code == 4


def test_guest_absent_for_a_token_with_vm_audit_is_absent(pve, fakepve_cafile):
    """With VM.Audit on /vms an absent guest is simply absent (None: locate says no such guest)."""
    fake, _ = pve
    fake.grant("pvegpu@pve!t", "/vms", "VM.Audit")
    assert _token_api(fake, fakepve_cafile).where(999) is None


@pytest.mark.fakepve(time_scale=1)
def test_https_read_timeout_is_bounded_and_named(pve, fakepve_cafile):
    """A node that does not answer: the read ends at api.timeout with host:port and the api.timeout hint."""
    fake, _ = pve
    fake.flaky_network(hang_rate=1.0, hang_secs=3)
    host, port = fake.url.split("//")[1].split(":")
    a = ProxmoxerPve(ProxmoxAPI(host, port=int(port), user="root@pam", token_name="pvegpu", token_value="a1b2",
                                verify_ssl=fakepve_cafile, timeout=0.5), node="pve1")
    with pytest.raises(PveApiError) as exc:
        a.ct_status(G)
    assert f"{host}:{port} did not answer within 0.5 s" in exc.value.message and "certificate" not in exc.value.hint
    fake.flaky_network()


# -- the local backend: a stand-in pvesh on PATH ---------------------------------------------------------------

def _pid_gone(pid: int, within: float = 10.0) -> bool:
    import time

    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def pvesh(tmp_path, monkeypatch):
    """install(rules) puts a stand-in pvesh first on PATH; returns (adapter factory, stub dir)."""
    from tests import stub_pvesh

    d = tmp_path / "bin"

    def make(rules, timeout=5.0, task_timeout=None):
        from pvegpu.adapters.pve import connect
        from pvegpu.core.settings import ApiSettings

        stub_pvesh.install(str(d), rules)
        return ProxmoxerPve(connect(ApiSettings(timeout=timeout), "local", task_timeout=task_timeout), node="pve1")

    monkeypatch.setenv("PATH", f"{d}:{__import__('os').environ['PATH']}")
    return make, d


def _in_thread(fn):
    """Run fn in a thread with a hang guard: (result, exception); fails the test if fn is still running after 30 s."""
    import threading

    box = {}

    def run():
        try:
            box["r"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["e"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "hung"
    return box.get("r"), box.get("e")


def test_pvesh_child_holding_the_pipe_is_killed_with_its_group(pvesh):
    """A hung pvesh whose child holds stdout: the call ends at api.timeout, the whole group is killed, the message says so."""
    make, d = pvesh
    a = make({"get /cluster/resources": {"child": 120, "sleep": 120, "pidfile": "child.pid"}}, timeout=0.5)
    _, exc = _in_thread(a.guests)
    assert isinstance(exc, PveApiError) and "did not finish within 0.5 s (killed with its process group)" in exc.message
    assert "api.timeout" in exc.hint
    assert _pid_gone(int((d / "child.pid").read_text()))


def test_pvesh_that_exits_but_leaves_a_child_on_the_pipe_answers(pvesh):
    """pvesh exits 0 with its answer while a child still holds stdout: the answer is used, the child is killed."""
    make, d = pvesh
    a = make({"get /cluster/resources": {"child": 120, "pidfile": "child.pid",
                                         "json": [{"type": "lxc", "vmid": 129, "node": "pve1"}]}})
    got, exc = _in_thread(a.guests)
    assert exc is None and got == [Guest(129, "pve1", "lxc")]
    assert _pid_gone(int((d / "child.pid").read_text()))


def test_pvesh_child_that_left_the_group_cannot_hold_pvegpu(pvesh):
    """A child in its own session (out of reach of the group kill) holding the pipe: the call still ends at its deadline."""
    import os
    import signal

    make, d = pvesh
    a = make({"get /cluster/resources": {"setsid_child": 120, "sleep": 120, "pidfile": "child.pid"}}, timeout=0.5)
    _, exc = _in_thread(a.guests)
    assert isinstance(exc, PveApiError) and "did not finish within 0.5 s" in exc.message
    os.kill(int((d / "child.pid").read_text()), signal.SIGKILL)  # our own stub's child


def test_pvesh_reads_use_api_timeout_and_stop_uses_task_timeout(pvesh):
    """A stop slower than api.timeout but within task_timeout succeeds; a status read as slow fails at api.timeout."""
    make, _ = pvesh
    slow = {"sleep": 2}
    a = make({"create /nodes/pve1/lxc/129/status/stop": slow | {"json": "UPID:pve1:0006A1F2:0B2C3D4E:66F0A1B2:vzstop:129:root@pam:"},
              "get /nodes/pve1/lxc/129/status/current": slow | {"json": {"status": "running"}}}, timeout=0.5, task_timeout=20)
    assert a.ct_stop(G).startswith("UPID:pve1:")
    with pytest.raises(PveApiError, match="within 0.5 s") as exc:
        a.ct_status(G)
    assert "api.timeout" in exc.value.hint


def test_pvesh_locale_warning_with_valid_answer_is_not_a_failure(pvesh, capsys):
    """Perl's "Setting locale failed" on stderr, exit 0, valid JSON: the answer is used (the warning is logged)."""
    make, _ = pvesh
    warn = "perl: warning: Setting locale failed.\nperl: warning: Please check that your locale settings:"
    a = make({"*": {"stderr": warn, "json": [{"type": "lxc", "vmid": 129, "node": "pve1"}]},
              "create /nodes/pve1/lxc/129/status/stop": {"stderr": warn, "json": "UPID:pve1:0006A1F2:0B2C3D4E:66F0A1B2:vzstop:129:root@pam:"}})
    assert a.guests() == [Guest(129, "pve1", "lxc")]
    assert a.ct_stop(G).startswith("UPID:")


@pytest.mark.parametrize("rule,text", [
    ({"exit": 1}, "pvesh exited with status 1"),
    ({"exit": 255, "stderr": "CT 129 not running"}, "500 CT 129 not running"),
    ({"exit": 2, "stderr": "403 Permission check failed (/vms/129, VM.PowerMgmt)"}, "lacks VM.PowerMgmt on /vms/129"),
    ({"raw": "garbage, not json"}, "did not answer JSON"),
    ({"raw": ""}, "answered nothing"),
    ({"raw_hex": "22ff fe22"}, "not UTF-8"),
    ({"json": {"errors": ""}}, "expected a task id"),
])
def test_pvesh_failures_are_exit_4_naming_the_call(pvesh, rule, text):
    """pvesh's exit status is checked; silent failure, invalid JSON, non-UTF-8 and a non-UPID task id are exit-4 errors."""
    make, _ = pvesh
    a = make({"create /nodes/pve1/lxc/129/status/stop": rule})
    with pytest.raises(PveApiError) as exc:
        a.ct_stop(G)
    assert exc.value.exit_code == 4 and exc.value.message.startswith("stop CT 129: ") and text in exc.value.message


def test_pvesh_task_log_before_the_upid_is_tolerated(pvesh):
    """pvesh runs a stop synchronously and prints its log before the UPID: the UPID is found."""
    make, _ = pvesh
    upid = "UPID:pve1:0006A1F2:0B2C3D4E:66F0A1B2:vzstop:129:root@pam:"
    a = make({"create /nodes/pve1/lxc/129/status/stop": {"raw": f"GUEST HOOK: 129 pre-stop\n\"{upid}\"\n"}})
    assert a.ct_stop(G) == upid


def test_pvesh_missing_gets_the_node_hint(tmp_path, monkeypatch):
    """No pvesh on PATH: the error says the local backend runs on a PVE node, not the HTTPS certificate hint."""
    from pvegpu.adapters.pve import connect
    from pvegpu.core.settings import ApiSettings

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PveApiError) as exc:
        ProxmoxerPve(connect(ApiSettings(), "local"), node="pve1").guests()
    assert "`pvesh` not found" in exc.value.message and "PVE node" in exc.value.hint and "certificate" not in exc.value.hint




class _TlsServer:
    """A real local HTTPS server with its own self-signed certificate, serving ``handler`` on ``host``."""

    def __init__(self, tmp, host: str, name: str, handler) -> None:
        import http.server
        import socket
        import ssl
        import threading

        from fakepve.certs import make_cert

        cert, key, self.der = make_cert(str(tmp), name=name, hosts=(host,))

        class S(http.server.ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self.server = S((host, 0), handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fingerprint(self) -> str:
        import hashlib

        return ":".join(f"{b:02X}" for b in hashlib.sha256(self.der).digest())

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Recorder(_TlsServer):
    """A real local HTTPS server (its own self-signed certificate) that answers every GET with an empty list
    and records which requests carried an Authorization header."""

    def __init__(self, tmp, family_host: str) -> None:
        import http.server

        seen: list[str] = []
        self.seen = seen

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                seen.append(self.headers.get("Authorization") or "")
                body = b'{"data": []}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        super().__init__(tmp, family_host, "other", H)


@pytest.fixture(params=["127.0.0.1", "::1"])
def recorder(request, tmp_path, monkeypatch):
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    r = _Recorder(tmp_path, request.param)
    yield request.param, r
    r.close()


def _host_forms(addr: str, port: int) -> list[tuple[str, int]]:
    if ":" in addr:  # IPv6: bare, bracketed, bracketed with port (the port setting then ignored)
        return [(addr, port), (f"[{addr}]", port), (f"[{addr}]:{port}", 1)]
    return [(addr, port), (f"{addr}:{port}", 1), ("localhost", port), (f"localhost:{port}", 1)]


def test_wrong_pin_never_sends_the_token_for_any_host_form(recorder, tmp_path):
    """With a wrong api.fingerprint, every host form (bare and bracketed IPv6, host:port, names) fails to
    connect and the server with the other certificate never receives an Authorization header."""
    from pvegpu.adapters.pve import connect
    from pvegpu.core.settings import ApiSettings

    addr, rec = recorder
    for host, port in _host_forms(addr, rec.port):
        cfg = ApiSettings(host=host, port=port, token_name="pvegpu", token_file=_token_file(tmp_path), timeout=5, fingerprint="AB" * 32)
        with pytest.raises(PveApiError, match="does not match api.fingerprint"):
            ProxmoxerPve(connect(cfg, "https")).guests()
    assert rec.seen == []


def test_right_pin_connects_for_every_host_form(recorder, tmp_path):
    """The same host forms with the server's own fingerprint connect and send the token (the pin is not just
    refusing everything)."""
    from pvegpu.adapters.pve import connect
    from pvegpu.core.settings import ApiSettings

    addr, rec = recorder
    forms = _host_forms(addr, rec.port)
    for host, port in forms:
        cfg = ApiSettings(host=host, port=port, token_name="pvegpu", token_file=_token_file(tmp_path), timeout=5, fingerprint=rec.fingerprint())
        assert ProxmoxerPve(connect(cfg, "https")).guests() == []
    assert len(rec.seen) == len(forms) and all(h.startswith("PVEAPIToken=root@pam!pvegpu=") for h in rec.seen)


@pytest.mark.parametrize("var", ["https_proxy", "HTTPS_PROXY", "all_proxy"])
def test_pin_with_proxy_in_environment_is_refused(recorder, tmp_path, monkeypatch, var):
    """With a proxy in the environment, pinning refuses to connect (a ConfigError) instead of sending the token
    over a connection the pin never checks; no request reaches the server or the 'proxy'."""
    from pvegpu.adapters.pve import connect
    from pvegpu.core.errors import ConfigError
    from pvegpu.core.settings import ApiSettings

    addr, rec = recorder
    host = f"[{addr}]" if ":" in addr else addr
    monkeypatch.setenv(var, f"http://{host}:{rec.port}")
    cfg = ApiSettings(host=addr, port=rec.port, token_name="pvegpu", token_file=_token_file(tmp_path), timeout=5, fingerprint="AB" * 32)
    with pytest.raises(ConfigError, match="proxy"):
        ProxmoxerPve(connect(cfg, "https")).guests()
    assert rec.seen == []


def test_pin_with_host_in_no_proxy_connects_directly(recorder, tmp_path, monkeypatch):
    """A proxy that no_proxy excludes for api.host does not block pinning; the pinned direct connection works."""
    from pvegpu.adapters.pve import connect
    from pvegpu.core.settings import ApiSettings

    addr, rec = recorder
    monkeypatch.setenv("https_proxy", "http://192.0.2.1:3128")
    monkeypatch.setenv("no_proxy", addr)
    cfg = ApiSettings(host=addr, port=rec.port, token_name="pvegpu", token_file=_token_file(tmp_path), timeout=5, fingerprint=rec.fingerprint())
    assert ProxmoxerPve(connect(cfg, "https")).guests() == []


def test_malformed_fingerprint_refused(tmp_path):
    """A fingerprint that is not 64 hex digits is a ConfigError, not a silent no-pin."""
    from pvegpu.adapters.pve import connect
    from pvegpu.core.errors import ConfigError
    from pvegpu.core.settings import ApiSettings

    cfg = ApiSettings(host="127.0.0.1", token_name="pvegpu", token_file=_token_file(tmp_path), fingerprint="AB:CD")
    with pytest.raises(ConfigError, match="fingerprint"):
        connect(cfg, "https")


def test_token_file_symlink_refused(tmp_path):
    """A symlink to a private token file is refused (O_NOFOLLOW), even though its target would pass."""
    real = tmp_path / "real"
    real.write_text("abc\n")
    real.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="symbolic link"):
        read_token(str(link))


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o700, 0o400, 0o660])
def test_token_file_mode_must_be_600(tmp_path, mode):
    """Only mode 0600 is accepted: group/other bits, exec bits or read-only-owner modes are refused."""
    f = tmp_path / "tok"
    f.write_text("abc\n")
    f.chmod(mode)
    with pytest.raises(ConfigError, match="mode"):
        read_token(str(f))


def test_token_file_not_regular_refused(tmp_path):
    """A FIFO (which would block a plain open) or a directory is refused without hanging."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_token(str(fifo))
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    with pytest.raises(ConfigError):
        read_token(str(d))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.root
def test_token_file_owned_by_other_user_refused(tmp_path):
    """A 0600 token file owned by another uid is refused when running as root."""
    f = tmp_path / "tok"
    f.write_text("abc\n")
    f.chmod(0o600)
    os.chown(f, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        read_token(str(f))


def test_token_file_multiline_refused(tmp_path):
    """A file with more than the secret (two lines) is refused rather than sent as a header."""
    f = tmp_path / "tok"
    f.write_text("abc\nevil: header\n")
    f.chmod(0o600)
    with pytest.raises(ConfigError):
        read_token(str(f))


@responses.activate
@pytest.mark.parametrize("exc,unanswered", [
    (requests.exceptions.ReadTimeout("Read timed out. (read timeout=30)"), True),
    (requests.ConnectionError("('Connection aborted.', RemoteDisconnected('Remote end closed connection'))"), True),
    (requests.exceptions.ConnectTimeout("timed out"), False),
    (requests.ConnectionError("[Errno 111] Connection refused"), False),
    (requests.ConnectionError("Failed to resolve 'pve.test' ([Errno -2] Name or service not known)"), False),
])
def test_a_request_that_may_have_been_carried_out_says_so(exc, unanswered):
    """A stop whose answer never came may still happen (PveNoAnswer); one that never reached PVE is a plain error."""
    from pvegpu.core.errors import PveNoAnswer

    responses.add(responses.POST, f"{BASE}/nodes/pve1/lxc/129/status/stop", body=exc)
    with pytest.raises(PveApiError) as err:
        offline_api().ct_stop(G)
    assert isinstance(err.value, PveNoAnswer) is unanswered


@responses.activate
@pytest.mark.parametrize("data", [{"dev0": ["/dev/nvidia0"]}, {"lxc": "garbage"}, {"dev0": {"a": 1}},
                                  {"lxc": [["lxc.mount.entry"]]}, {"dev0": True}])
def test_config_with_wrongly_typed_fields_is_exit_4_not_no_gpu(data):
    """A config answer whose fields have the wrong types names the call (exit 4); it is never read as 'no GPU'."""
    responses.add(responses.GET, f"{BASE}/nodes/pve1/lxc/129/config", json={"data": data})
    with pytest.raises(PveApiError) as exc:
        offline_api().ct_config(G)
    assert exc.value.exit_code == 4 and "read CT 129 config" in exc.value.message


class _Dripper(_TlsServer):
    """A real local HTTPS server that answers every GET one byte at a time (a hostile or broken proxy)."""

    def __init__(self, tmp) -> None:
        import http.server
        import time

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                body = b'{"data": [' + b" " * 200 + b"]}"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    for b in body:
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                        time.sleep(0.05)
                except OSError:
                    pass

            def log_message(self, *a):
                pass

        super().__init__(tmp, "127.0.0.1", "drip", H)


def test_an_answer_dripped_slowly_is_cut_at_the_total_deadline(tmp_path, monkeypatch):
    """api.timeout bounds the whole answer, not each read: a server dripping a byte every 50 ms is given up after
    about the timeout (exit 4, a read timeout that may have been carried out), not after the whole drip (~11 s)."""
    import time

    from pvegpu.adapters.pve import connect
    from pvegpu.core.errors import PveNoAnswer
    from pvegpu.core.settings import ApiSettings

    for var in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    d = _Dripper(tmp_path)
    try:
        cfg = ApiSettings(host="127.0.0.1", port=d.port, token_name="pvegpu", token_file=_token_file(tmp_path), timeout=1,
                          fingerprint=d.fingerprint())
        t = time.monotonic()
        with pytest.raises(PveNoAnswer, match="did not answer within"):
            ProxmoxerPve(connect(cfg, "https")).guests()
        assert time.monotonic() - t < 4
    finally:
        d.close()


@responses.activate
def test_an_answer_larger_than_the_cap_is_refused(tmp_path, monkeypatch):
    """A gigantic answer is cut at 32 MiB (exit 4, naming the host), never read whole into memory."""
    from pvegpu.adapters import pve as pve_mod
    from pvegpu.adapters.pve import connect
    from pvegpu.core.settings import ApiSettings

    monkeypatch.setattr(pve_mod, "MAX_ANSWER", 1024 * 1024)
    responses.add(responses.GET, "https://pve.test:8006/api2/json/cluster/resources", body=b'{"data": [' + b" " * (2 << 20) + b"]}")
    cfg = ApiSettings(host="pve.test", port=8006, token_name="pvegpu", token_file=_token_file(tmp_path), timeout=5)
    with pytest.raises(PveApiError, match="larger than 1 MiB"):
        ProxmoxerPve(connect(cfg, "https")).guests()


def test_depth_bound_skips_strings_and_escapes():
    """The nesting bound counts only structural brackets: brackets and escaped quotes inside strings do not count."""
    from pvegpu.adapters.pvesh import too_deep

    assert not too_deep(b'{"a": "' + b"[" * 500 + b'\\"' + b"{" * 500 + b'"}')
    assert too_deep(b"[" * 65 + b"]" * 65) and not too_deep(b"[" * 64 + b"]" * 64)
    assert too_deep(b'[[{"x": "]]]]"' + b"[" * 100)


def test_task_answer_about_another_task_refused():
    """A task status answer naming another UPID (a misrouting proxy) is a bad answer, not this task's status."""
    from pvegpu.adapters import answers

    mine = "UPID:pve1:0006A1F2:0B2C3D4E:66F0A1B2:vzstop:129:root@pam:"
    other = mine.replace("vzstop:129", "vzstop:130")
    with pytest.raises(answers.BadAnswer, match="about task"):
        answers.task_status({"upid": other, "status": "stopped", "exitstatus": "OK"}, mine)
    assert answers.task_status({"upid": mine, "status": "stopped", "exitstatus": "OK"}, mine)["exitstatus"] == "OK"
    with pytest.raises(answers.BadAnswer, match="about guest 130"):
        answers.ct_status({"status": "running", "vmid": 130}, 129)
    assert answers.ct_status({"status": "running", "vmid": "129", "ha": {"managed": 1, "state": "error"}}, 129)[3] == "error"


def test_depth_scan_is_linear_on_a_hostile_unclosed_string():
    """An answer with many brackets and a string that never closes, full of escaped quotes (quadratic for a naive
    scan: tens of seconds at 100 KiB), is judged in one pass: 1 MiB well within a second."""
    import time

    from pvegpu.adapters.pvesh import too_deep

    body = b"[" * 10 + b'"x' + b'\\"' * (1 << 19) + b"{" * 70
    t = time.perf_counter()
    assert too_deep(body) is False and too_deep(b"[" * 65 + b"]" * 65) is True
    assert time.perf_counter() - t < 1.0
