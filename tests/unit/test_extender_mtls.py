"""Issue 14: the extender answers only kube-scheduler. The operator's real server
(:meth:`kvgpu.runtime.Runtime.start_extender`) on loopback with the dev PKI: no client
certificate, one from another CA, one of the right CA naming another identity, and plain HTTP
are refused before any handler runs (no pod read, no claim, no Binding, no Event); the
scheduler's certificate is answered. The plain metrics port serves no scheduler verb."""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvgpu import kube
from kvgpu.devcluster.pki import issue_leaf, make_ca, make_extender_pki
from kvgpu.extender.schedconfig import ExtenderTLS, extender_entries, scheduler_configuration
from kvgpu.extender.server import Extender
from kvgpu.extender.tls import parse_allowed
from kvgpu.metrics import OperatorMetrics
from kvgpu.runtime import OperatorConfig, Runtime

from tests.unit.extender_helpers import UID, FakeKube, make_state

GPU_POD = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "namespace": "ns", "uid": UID, "labels": {"kvgpu.io/managed": "true"}},
           "spec": {"schedulerName": "kvgpu-scheduler", "containers": [
               {"name": "main", "image": "x", "resources": {"limits": {
                   "nvidia.com/gpu": 1, "nvidia.com/gpumem": "15000"}}}]}}
BIND = json.dumps({"podName": "p", "podNamespace": "ns", "podUID": UID, "node": "n0"}).encode()
FILTER = json.dumps({"pod": GPU_POD, "nodenames": ["n0", "n1", "n2"]}).encode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("extender-pki")
    make_extender_pki(d)
    # the scheduler's name, signed by a CA the extender does not trust
    make_ca(d, "other-ca", "someone-else")
    issue_leaf(d, "other-client", "other-ca", "kvgpu-scheduler")
    # signed by the extender's CA, but not an allowed identity
    issue_leaf(d, "intruder", "extender-ca", "tenant-pod")
    return d


class Served:
    def __init__(self, pki: Path, monkeypatch: pytest.MonkeyPatch, **cfg: Any) -> None:
        self.fake = FakeKube()
        self.fake.pod = GPU_POD
        for name in ("get_pod", "create_claim", "get_claim", "delete_claim", "patch_pod_metadata",
                     "create_binding", "patch_claim_status", "post_event"):
            monkeypatch.setattr(kube, name, getattr(self.fake, name))
        tls = {} if cfg.get("extender_insecure") else {
            "extender_cert": str(pki / "extender.crt"), "extender_key": str(pki / "extender.key"),
            "extender_client_ca": str(pki / "extender-ca.crt")}
        self.rt = Runtime(OperatorConfig(extender_port=0, metrics_port=0, **tls, **cfg))
        self.rt.state = make_state()
        self.rt.extender = Extender(self.rt.state, None, OperatorMetrics())
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.rt.start_extender())
        self.pki = pki

    def ctx(self, stem: str | None) -> ssl.SSLContext:
        c = ssl.create_default_context(cafile=str(self.pki / "extender-ca.crt"))
        if stem:
            c.load_cert_chain(str(self.pki / f"{stem}.crt"), str(self.pki / f"{stem}.key"))
        return c

    def post(self, verb: str, body: bytes, stem: str | None = "extender-client", scheme: str = "https",
             host: str = "127.0.0.1") -> tuple[int, Any]:
        async def go() -> tuple[int, Any]:
            ssl_arg: Any = self.ctx(stem) if scheme == "https" else None
            async with aiohttp.ClientSession() as s, s.post(
                    f"{scheme}://{host}:{self.rt.extender_port}/scheduler/{verb}", data=body, ssl=ssl_arg,
                    headers={"Content-Type": "application/json"}, timeout=aiohttp.ClientTimeout(total=10)) as r:
                text = await r.text()
                try:
                    return r.status, json.loads(text)
                except ValueError:
                    return r.status, text

        return self.loop.run_until_complete(go())

    def refused(self, verb: str, body: bytes, **kw: Any) -> str:
        """The error a refused call gets: a failed TLS handshake, a dropped connection or 401/403."""
        try:
            status, data = self.post(verb, body, **kw)
        except (aiohttp.ClientError, ssl.SSLError, ConnectionError) as e:
            return f"connection refused: {type(e).__name__}"
        assert status in (401, 403), (status, data)
        return f"HTTP {status}"

    def close(self) -> None:
        self.loop.run_until_complete(self.rt.cleanup())
        self.loop.close()


@pytest.fixture
def served(pki: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    s = Served(pki, monkeypatch)
    yield s
    s.close()


def test_the_schedulers_certificate_is_answered(served: Served) -> None:
    status, data = served.post("filter", FILTER)
    assert status == 200 and data["nodenames"] == ["n0"], data
    assert served.post("bind", BIND) == (200, {})
    assert "binding" in served.fake.calls
    assert served.post("prioritize", FILTER)[0] == 200


def connections(served: Served) -> float:
    return served.rt.metrics.registry.get_sample_value("kvgpu_extender_connections_total") or 0.0


def test_each_tls_connection_is_counted(served: Served) -> None:
    """``kvgpu_extender_connections_total``: one per completed handshake (each call here opens
    its own connection); a refused handshake is not counted."""
    assert connections(served) == 0
    served.post("filter", FILTER)
    served.post("bind", BIND)
    assert connections(served) == 2
    served.refused("bind", BIND, stem="other-client")
    assert connections(served) == 2


@pytest.mark.parametrize("verb,body", [("filter", FILTER), ("prioritize", FILTER), ("bind", BIND)])
def test_no_client_certificate_is_refused(served: Served, verb: str, body: bytes) -> None:
    served.refused(verb, body, stem=None)
    assert served.fake.calls == [], "nothing reached the API"
    assert served.rt.state.ledger.pod_node(UID) is None


@pytest.mark.parametrize("verb,body", [("filter", FILTER), ("bind", BIND)])
def test_a_certificate_of_another_ca_is_refused(served: Served, verb: str, body: bytes) -> None:
    """Same CN as the scheduler, another CA: the handshake fails."""
    assert served.refused(verb, body, stem="other-client").startswith("connection refused")
    assert served.fake.calls == []


def test_a_certificate_of_the_ca_with_another_identity_is_refused(served: Served) -> None:
    assert served.refused("bind", BIND, stem="intruder") == "HTTP 403"
    assert served.refused("filter", FILTER, stem="intruder") == "HTTP 403"
    assert served.fake.calls == [] and served.rt.state.ledger.pod_node(UID) is None


def test_plain_http_is_refused(served: Served) -> None:
    served.refused("bind", BIND, scheme="http")
    assert served.fake.calls == []


def test_metrics_port_serves_probes_and_metrics_but_no_verb(served: Served) -> None:
    base = f"http://127.0.0.1:{served.rt.metrics_port}"

    async def go() -> list[int]:
        async with aiohttp.ClientSession() as s:
            out = []
            for path in ("/healthz", "/readyz", "/metrics"):
                async with s.get(base + path) as r:
                    out.append(r.status)
            async with s.post(base + "/scheduler/bind", data=BIND) as r:
                out.append(r.status)
            return out

    *probes, bind = served.loop.run_until_complete(go())
    assert probes == [200, 200, 200] and bind in (404, 405)
    assert served.fake.calls == []


def test_allowed_clients_are_configurable(pki: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Served(pki, monkeypatch, extender_allowed_clients=("tenant-pod",))
    try:
        assert s.post("bind", BIND, stem="intruder") == (200, {})
        assert s.refused("bind", BIND) == "HTTP 403"  # the default identity is no longer answered
    finally:
        s.close()


def test_insecure_is_plain_http_only_when_asked(pki: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = Runtime(OperatorConfig(extender_port=0))
    rt.extender = Extender(make_state(), None, OperatorMetrics())
    with pytest.raises(ValueError, match="--extender-insecure"):
        asyncio.run(rt.start_extender())
    s = Served(pki, monkeypatch, extender_insecure=True)
    try:
        assert s.rt.extender_url.startswith("http://")
        assert s.post("bind", BIND, scheme="http") == (200, {})
    finally:
        s.close()


def test_cli_requires_certificates_or_insecure(pki: Path) -> None:
    from click.testing import CliRunner
    from kvgpu.cli.main import main

    out = CliRunner().invoke(main, ["operator", "--extender-address=127.0.0.1:0"])
    assert out.exit_code == 2 and "--extender-insecure" in out.output
    ctx = main.commands["operator"].make_context("operator", [
        f"--extender-cert={pki / 'extender.crt'}", f"--extender-key={pki / 'extender.key'}",
        f"--extender-client-ca={pki / 'extender-ca.crt'}", "--extender-allowed-clients=a,b",
        "--extender-allowed-clients=c", "--metrics-address=0.0.0.0:9090"])
    assert ctx.params["extender_allowed_clients"] == ("a,b", "c")
    assert parse_allowed(ctx.params["extender_allowed_clients"]) == ("a", "b", "c")
    assert parse_allowed(()) == ("kvgpu-scheduler",)


def test_renewed_certificates_are_reloaded(served: Served) -> None:
    import os

    reloader = served.rt._tls_reloader
    assert reloader is not None and not reloader.check()
    issue_leaf(served.pki, "extender", "extender-ca", "kvgpu-extender", server=True, dns=("localhost",),
               ips=("127.0.0.1",))
    st = (served.pki / "extender.crt").stat()
    os.utime(served.pki / "extender.crt", (st.st_atime, st.st_mtime + 5))
    assert reloader.check()
    assert served.post("filter", FILTER)[0] == 200


def test_scheduler_configuration_carries_its_tls() -> None:
    tls = ExtenderTLS(cert_file="/c/tls.crt", key_file="/c/tls.key", ca_file="/c/ca.crt")
    exts = scheduler_configuration("https://op:8888/scheduler", tls=tls)["extenders"]
    assert len(exts) == 2
    for ext in exts:
        assert ext["enableHTTPS"] is True
        assert ext["tlsConfig"] == {"certFile": "/c/tls.crt", "keyFile": "/c/tls.key", "caFile": "/c/ca.crt"}
    assert all("tlsConfig" not in e for e in extender_entries("http://op:8888/scheduler"))
    with pytest.raises(ValueError):
        extender_entries("https://op:8888/scheduler")  # https without a client certificate
    with pytest.raises(ValueError):
        extender_entries("http://op:8888/scheduler", tls=tls)


def test_filter_and_bind_are_separate_extenders_of_one_server() -> None:
    """kube-scheduler keeps one connection pool per extender entry: filter (serial) and bind
    (many at once) must not share one, and kube-scheduler accepts only one binder."""
    placing, binding = scheduler_configuration("http://op:8888/scheduler")["extenders"]
    assert placing["urlPrefix"] == binding["urlPrefix"] == "http://op:8888/scheduler"
    assert (placing["filterVerb"], placing["prioritizeVerb"]) == ("filter", "prioritize")
    assert "bindVerb" not in placing and placing["weight"] > 0 and placing["nodeCacheCapable"] is True
    assert binding["bindVerb"] == "bind"
    assert not {"filterVerb", "prioritizeVerb"} & binding.keys()
    assert placing["ignorable"] is binding["ignorable"] is False


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> ssl.SSLObject:
    """Run a TLS handshake between the two contexts in memory; returns the client's side."""
    si, so, ci, co = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    srv, cli = server.wrap_bio(si, so, server_side=True), client.wrap_bio(ci, co)
    for _ in range(10):
        for side, out, into in ((cli, co, si), (srv, so, ci)):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
            into.write(out.read())
    try:
        cli.read(1)  # takes the post-handshake messages (TLS 1.3 tickets), if any
    except ssl.SSLWantReadError:
        pass
    return cli


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_extender_issues_no_session_tickets(pki: Path, version: ssl.TLSVersion) -> None:
    """kube-scheduler never resumes: the server sends no ticket (a wasted third of its handshake
    CPU), and still verifies the client certificate."""
    from kvgpu.extender.tls import server_context

    server = server_context(str(pki / "extender.crt"), str(pki / "extender.key"), str(pki / "extender-ca.crt"))
    client = ssl.create_default_context(cafile=str(pki / "extender-ca.crt"))
    client.check_hostname = False
    client.minimum_version = client.maximum_version = version
    client.load_cert_chain(pki / "extender-client.crt", pki / "extender-client.key")
    cli = _handshake(server, client)
    assert cli.version() == {ssl.TLSVersion.TLSv1_2: "TLSv1.2", ssl.TLSVersion.TLSv1_3: "TLSv1.3"}[version]
    assert cli.session is not None and not cli.session.has_ticket
    nocert = ssl.create_default_context(cafile=str(pki / "extender-ca.crt"))
    nocert.check_hostname = False
    with pytest.raises(ssl.SSLError, match="CERTIFICATE"):
        _handshake(server, nocert)
