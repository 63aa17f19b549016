"""The Proxmox adapter: error mapping with `responses`, and real HTTPS against fakepve (token auth, tasks, knobs)."""

from __future__ import annotations

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
    with pytest.raises(PveApiError, match=f"does not match api.fingerprint") as exc:
        ProxmoxerPve(connect(ApiSettings(**base, fingerprint="00" * 32), "https")).guests()
    assert "pvenode cert info" in exc.value.hint
    with pytest.raises(PveApiError, match=f"TLS verification of {host}:{port} failed") as exc:
        ProxmoxerPve(connect(ApiSettings(**base, verify="true"), "https")).guests()
    assert "pve-root-ca.pem" in exc.value.hint
