"""The Proxmox adapter: error mapping with `responses`, and real HTTPS against fakepve (token auth, tasks, knobs)."""

from __future__ import annotations

import os

import pytest
import requests
import responses
from proxmoxer import ProxmoxAPI

from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.pve import ProxmoxerPve, read_token
from pvegpu.errors import ConfigError, PveApiError, TaskFailed, TaskTimeout
from pvegpu.model import Guest
from pvegpu.reclaim import Ports, ResetPolicy, Resetter

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
    """A refused connection is a PveApiError, not a requests traceback."""
    responses.add(responses.GET, f"{BASE}/cluster/resources", body=requests.ConnectionError("refused"))
    with pytest.raises(PveApiError, match="cannot reach the API"):
        offline_api().guests()


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


def waiter(adapter, task_timeout=10.0):
    r = Resetter(129, Ports(adapter, None, None, SystemClock()), ResetPolicy(task_timeout=task_timeout))  # type: ignore[arg-type]
    r.located = type("L", (), {"guest": G})()
    return r


def test_token_auth_config_and_stop_start_tasks(pve):
    """Over real HTTPS with a verified certificate and a token: locate, read config, stop and start tasks end OK."""
    fake, a = pve
    assert a.where(129) == Guest(129, "pve1", "lxc", "llm129")
    assert a.ct_config(G)["dev0"] == "/dev/nvidia0,gid=44"
    w = waiter(a)
    w._task(a.ct_stop(G), "stop")
    assert a.ct_status(G).status == "stopped"
    w._task(a.ct_start(G), "start")
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
    waiter(a)._task(a.ct_stop(G), "stop")
    with pytest.raises(PveApiError, match="not running"):
        a.ct_stop(G)
    fake.ct129.lock = "backup"
    with pytest.raises(PveApiError, match="locked"):  # at the POST, or as the task's failure
        waiter(a)._task(a.ct_start(G), "start")


def test_did_not_stop_task_failure(pve):
    """A stop task that fails inside PVE (did_not_stop) is a TaskFailed carrying PVE's message."""
    fake, a = pve
    fake.fail("POST", "/nodes/pve1/lxc/129/status/stop", error="did_not_stop")
    with pytest.raises((TaskFailed, PveApiError)):
        waiter(a)._task(a.ct_stop(G), "stop")


def test_start_error_hookscript_refusal_reported(pve):
    """A start whose task ends with the guard's refusal is reported as that refusal, with the check hint."""
    fake, a = pve
    waiter(a)._task(a.ct_stop(G), "stop")
    fake.ct129.start_error = "hookscript error for 129 on pre-start: command '/var/lib/vz/snippets/pvegpu-guard 129 pre-start' failed: exit code 10"
    with pytest.raises(TaskFailed) as exc:
        waiter(a)._task(a.ct_start(G), "start")
    assert "hookscript error for 129 on pre-start" in exc.value.message and "pvegpu check 129" in exc.value.hint


@pytest.mark.fakepve(time_scale=0.05)
def test_slow_task_times_out(pve):
    """A stop task slower than task_timeout raises TaskTimeout naming the UPID."""
    fake, a = pve
    fake.ct129.stop_secs = 100
    with pytest.raises(TaskTimeout, match="still running"):
        waiter(a, task_timeout=0.5)._task(a.ct_stop(G), "stop")


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
    from pvegpu.settings import ApiSettings

    fake, _ = pve
    host, port = fake.url.split("//")[1].split(":")
    base = dict(host=host, port=int(port), token_name="pvegpu", token_file=_token_file(tmp_path), timeout=10)
    assert ProxmoxerPve(connect(ApiSettings(**base, verify=fakepve_cafile), "https")).guests()
    der = ssl.PEM_cert_to_DER_cert(open(fakepve_cafile).read())
    fp = ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())
    assert ProxmoxerPve(connect(ApiSettings(**base, fingerprint=fp), "https")).guests()
    with pytest.raises(PveApiError, match="cannot reach the API"):
        ProxmoxerPve(connect(ApiSettings(**base, fingerprint="00" * 32), "https")).guests()
    with pytest.raises(PveApiError, match="cannot reach the API"):
        ProxmoxerPve(connect(ApiSettings(**base, verify="true"), "https")).guests()


class _Recorder:
    """A real local HTTPS server (its own self-signed certificate) that answers every GET with an empty list
    and records which requests carried an Authorization header."""

    def __init__(self, tmp, family_host: str) -> None:
        import http.server
        import socket
        import ssl
        import threading

        from fakepve.certs import make_cert

        cert, key, self.der = make_cert(str(tmp), name="other", hosts=("::1",))
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

        class S(http.server.ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in family_host else socket.AF_INET

        self.server = S((family_host, 0), H)
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
    from pvegpu.settings import ApiSettings

    addr, rec = recorder
    for host, port in _host_forms(addr, rec.port):
        cfg = ApiSettings(host=host, port=port, token_name="pvegpu", token_file=_token_file(tmp_path), timeout=5, fingerprint="AB" * 32)
        with pytest.raises(PveApiError, match="cannot reach the API"):
            ProxmoxerPve(connect(cfg, "https")).guests()
    assert rec.seen == []


def test_right_pin_connects_for_every_host_form(recorder, tmp_path):
    """The same host forms with the server's own fingerprint connect and send the token (the pin is not just
    refusing everything)."""
    from pvegpu.adapters.pve import connect
    from pvegpu.settings import ApiSettings

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
    from pvegpu.errors import ConfigError
    from pvegpu.settings import ApiSettings

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
    from pvegpu.settings import ApiSettings

    addr, rec = recorder
    monkeypatch.setenv("https_proxy", "http://192.0.2.1:3128")
    monkeypatch.setenv("no_proxy", addr)
    cfg = ApiSettings(host=addr, port=rec.port, token_name="pvegpu", token_file=_token_file(tmp_path), timeout=5, fingerprint=rec.fingerprint())
    assert ProxmoxerPve(connect(cfg, "https")).guests() == []


def test_malformed_fingerprint_refused(tmp_path):
    """A fingerprint that is not 64 hex digits is a ConfigError, not a silent no-pin."""
    from pvegpu.adapters.pve import connect
    from pvegpu.errors import ConfigError
    from pvegpu.settings import ApiSettings

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
