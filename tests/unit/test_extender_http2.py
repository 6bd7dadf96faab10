"""The extender's HTTP/2 server (kvgpu.extender.http2), driven by the ``h2`` library as a client:
over an in-memory transport for the protocol's edge cases (identity, flow control, limits,
resets), and on the operator's real extender port (TLS, ALPN) as kube-scheduler reaches it."""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any

import h2.config
import h2.connection
import h2.events
from kvgpu.extender.http2 import H2Server

from tests.unit.test_extender_mtls import BIND, FILTER, UID, Served, connections, pki, served

__all__ = ["pki", "served"]  # fixtures


def http2_connections(served: Served) -> float:
    return served.rt.metrics.registry.get_sample_value("kvgpu_extender_http2_connections_total") or 0.0

ALLOWED = ("kvgpu-scheduler",)


class _Transport:
    """What H2Server needs of a TLS transport: writes collected, a peer certificate."""

    def __init__(self, cn: str = "kvgpu-scheduler") -> None:
        self.out = bytearray()
        self.closed = False
        self.peercert = {"subject": ((("commonName", cn),),)}

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return self.peercert if name == "peercert" else None


class _Client:
    """An h2 client wired to an H2Server through :class:`_Transport`."""

    def __init__(self, server: H2Server, transport: _Transport) -> None:
        self.server, self.t = server, transport
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        server.connection_made(transport)  # type: ignore[arg-type]
        self.events: list[Any] = []
        self.pump()

    def pump(self) -> None:
        """Deliver both sides' pending bytes until neither has any."""
        while True:
            out = self.conn.data_to_send()
            if out:
                self.server.data_received(out)
            if not self.t.out:
                if not out:
                    return
                continue
            data, self.t.out[:] = bytes(self.t.out), b""
            self.events += self.conn.receive_data(data)

    def request(self, path: str, body: bytes, *, end: bool = True) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(b":method", b"POST"), (b":path", path.encode()), (b":scheme", b"https"),
                                     (b":authority", b"op")], end_stream=not body and end)
        if body:
            while body:
                n = min(len(body), self.conn.max_outbound_frame_size, self.conn.local_flow_control_window(sid))
                self.conn.send_data(sid, body[:n], end_stream=end and n == len(body))
                body = body[n:]
                self.pump()
        self.pump()
        return sid

    def answer(self, sid: int) -> tuple[int, bytes, bool]:
        return _answer(self.events, sid)


def _answer(events: list[Any], sid: int) -> tuple[int, bytes, bool]:
    """(status, body so far, ended) of stream ``sid`` from a client's ``events``."""
    status, body, ended = 0, b"", False
    for ev in events:
        if getattr(ev, "stream_id", None) != sid:
            continue
        if isinstance(ev, h2.events.ResponseReceived):
            status = int(dict(ev.headers)[b":status"])
        elif isinstance(ev, h2.events.DataReceived):
            body += ev.data
        elif isinstance(ev, h2.events.StreamEnded):
            ended = True
    return status, body, ended


async def _settle(c: _Client) -> None:
    for _ in range(5):
        await asyncio.sleep(0)
    c.pump()


def test_answers_concurrent_requests_in_the_order_they_finish() -> None:
    async def go() -> None:
        gate = asyncio.Event()

        async def handle(method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
            if path == "/slow":
                await gate.wait()
            return 200, "application/json", json.dumps({"path": path, "got": len(body)}).encode()

        c = _Client(H2Server(handle, ALLOWED, 1 << 20), _Transport())
        slow = c.request("/slow", b"x" * 10)
        fast = c.request("/fast", b"y" * 100_000)  # more than one frame and the initial window
        await _settle(c)
        assert c.answer(fast) == (200, b'{"path": "/fast", "got": 100000}', True)
        assert c.answer(slow)[2] is False
        gate.set()
        await _settle(c)
        assert c.answer(slow) == (200, b'{"path": "/slow", "got": 10}', True)

    asyncio.run(go())


def test_an_answer_larger_than_the_window_waits_for_window_updates() -> None:
    big = bytes(range(256)) * 1000  # 256,000 bytes: ~4 x the default 65,535-byte window

    async def go() -> None:
        async def handle(method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
            return 200, "application/octet-stream", big

        c = _Client(H2Server(handle, ALLOWED, 1 << 20), _Transport())
        sid = c.request("/big", b"")
        await _settle(c)
        status, got, ended = c.answer(sid)
        assert status == 200 and 0 < len(got) <= 65_535 and not ended  # held by flow control
        for _ in range(10):  # the client takes the data: its window updates release the rest
            for ev in c.events:
                if isinstance(ev, h2.events.DataReceived) and ev.flow_controlled_length:
                    c.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    ev.flow_controlled_length = 0
            c.pump()
        assert c.answer(sid) == (200, big, True)

    asyncio.run(go())


def test_a_client_identity_not_allowed_is_refused_before_any_request() -> None:
    called: list[str] = []

    async def handle(method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        called.append(path)
        return 200, "text/plain", b"ok"

    async def go() -> None:
        t = _Transport(cn="some-pod")
        server = H2Server(handle, ALLOWED, 1 << 20)
        c = _Client(server, t)
        assert t.closed
        assert any(isinstance(ev, h2.events.ConnectionTerminated) for ev in c.events)
        # a request that arrives anyway (bytes already in flight) is not read
        other = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        other.initiate_connection()
        other.send_headers(1, [(":method", "POST"), (":path", "/scheduler/bind"), (":scheme", "https"),
                               (":authority", "op")], end_stream=True)
        server.data_received(other.data_to_send())
        await asyncio.sleep(0)
        assert not called and not t.out

    asyncio.run(go())


def test_a_body_over_the_limit_gets_413_and_no_call() -> None:
    async def go() -> None:
        called: list[str] = []

        async def handle(method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
            called.append(path)
            return 200, "text/plain", b"ok"

        c = _Client(H2Server(handle, ALLOWED, 1000), _Transport())
        sid = c.request("/scheduler/filter", b"z" * 5000)
        await _settle(c)
        assert c.answer(sid)[0] == 413 and c.answer(sid)[2]
        assert not called

    asyncio.run(go())


def test_a_reset_stream_and_a_lost_connection_let_their_requests_finish() -> None:
    """As aiohttp does for HTTP/1.1: a bind cut off half-way would leave a claim without its
    Binding. The request runs to its end; its answer goes nowhere."""

    async def go() -> None:
        gate = asyncio.Event()
        finished: list[str] = []

        async def handle(method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
            await gate.wait()
            finished.append(path)
            return 200, "text/plain", b"done"

        server = H2Server(handle, ALLOWED, 1 << 20)
        t = _Transport()
        c = _Client(server, t)
        a = c.request("/a", b"1")
        b = c.request("/b", b"2")
        await _settle(c)
        c.conn.reset_stream(a)
        c.pump()
        gate.set()
        await _settle(c)
        assert finished == ["/a", "/b"]
        assert c.answer(a)[0] == 0 and c.answer(b) == (200, b"done", True)  # nothing sent on the reset stream
        gate.clear()
        d = c.request("/d", b"3")
        await _settle(c)
        server.connection_lost(None)
        sent = len(t.out)
        gate.set()
        await _settle(c)
        assert finished == ["/a", "/b", "/d"] and len(t.out) == sent and c.answer(d)[0] == 0

    asyncio.run(go())


def test_a_handler_error_answers_500_and_keeps_the_connection() -> None:
    async def go() -> None:
        async def handle(method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
            if path == "/boom":
                raise RuntimeError("bug")
            return 200, "text/plain", b"fine"

        t = _Transport()
        c = _Client(H2Server(handle, ALLOWED, 1 << 20), t)
        boom = c.request("/boom", b"")
        await _settle(c)
        after = c.request("/ok", b"")
        await _settle(c)
        assert c.answer(boom)[0] == 500 and c.answer(after) == (200, b"fine", True) and not t.closed

    asyncio.run(go())


# --------------------------------------------------------------------------- the operator's real port


async def _h2_calls(port: int, ctx: ssl.SSLContext, calls: list[tuple[str, bytes]]) -> list[tuple[int, Any]]:
    """Send ``calls`` (path, body) at once as streams of one HTTP/2 connection; their answers
    (status, JSON or text), or ``(0, None)`` for each when the server ends the connection."""
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")
    assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    sids = []
    for path, body in calls:
        sid = conn.get_next_available_stream_id()
        sids.append(sid)
        conn.send_headers(sid, [(b":method", b"POST"), (b":path", path.encode()), (b":scheme", b"https"),
                                (b":authority", b"localhost")])
        conn.send_data(sid, body, end_stream=True)
    writer.write(conn.data_to_send())
    events: list[Any] = []
    try:
        while not all(_answer(events, sid)[2] for sid in sids):
            data = await asyncio.wait_for(reader.read(65536), 10)
            if not data:
                break
            for ev in conn.receive_data(data):
                events.append(ev)
                if isinstance(ev, h2.events.DataReceived):
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    return [(0, None)] * len(sids)
            writer.write(conn.data_to_send())
    finally:
        writer.close()
    out: list[tuple[int, Any]] = []
    for sid in sids:
        status, body, _ = _answer(events, sid)
        try:
            out.append((status, json.loads(body)))
        except ValueError:
            out.append((status, body.decode()))
    return out


def test_the_operators_port_answers_kube_scheduler_over_http2(served: Served) -> None:
    """The real extender port (Runtime.start_extender): filter, prioritize and bind as streams
    of one connection, one TLS handshake for all of them; HTTP/1.1 still answered beside it."""
    answers = served.loop.run_until_complete(_h2_calls(served.rt.extender_port, served.ctx("extender-client"), [
        ("/scheduler/filter", FILTER), ("/scheduler/prioritize", FILTER), ("/scheduler/metrics", b"")]))
    assert answers[0][0] == 200 and answers[0][1]["nodenames"] == ["n0"], answers
    assert answers[1][0] == 200 and answers[2][0] == 404
    [bound] = served.loop.run_until_complete(_h2_calls(served.rt.extender_port, served.ctx("extender-client"),
                                                       [("/scheduler/bind", BIND)]))
    assert bound == (200, {}) and "binding" in served.fake.calls
    assert connections(served) == 2 and http2_connections(served) == 2
    assert served.post("filter", FILTER)[0] == 200  # HTTP/1.1 on the same port
    assert connections(served) == 3 and http2_connections(served) == 2


def test_http2_refuses_an_identity_that_is_not_allowed_before_any_call(served: Served) -> None:
    """Signed by the extender's CA but naming a tenant: the connection ends before a request is
    read (no pod read, no claim, no Binding, no Event)."""
    answers = served.loop.run_until_complete(_h2_calls(served.rt.extender_port, served.ctx("intruder"), [
        ("/scheduler/bind", BIND), ("/scheduler/filter", FILTER)]))
    assert answers == [(0, None), (0, None)]
    assert served.fake.calls == [] and served.rt.state.ledger.pod_node(UID) is None


def test_http2_refuses_a_certificate_of_another_ca(served: Served) -> None:
    """The scheduler's name, another CA: TLS 1.3 lets the client finish its side of the handshake,
    then the server refuses the certificate and the connection ends without an answer."""
    try:
        answers = served.loop.run_until_complete(_h2_calls(served.rt.extender_port, served.ctx("other-client"),
                                                           [("/scheduler/bind", BIND)]))
    except (ssl.SSLError, ConnectionError):
        answers = [(0, None)]
    assert [status for status, _ in answers] == [0]
    assert served.fake.calls == [] and connections(served) == 0


def test_the_extender_answers_its_verbs_over_http2_and_nothing_else() -> None:
    from kvgpu.extender.server import Extender
    from kvgpu.metrics import OperatorMetrics

    from tests.unit.extender_helpers import make_state

    ext = Extender(make_state(), None, OperatorMetrics())

    async def go() -> None:
        status, ctype, body = await ext.answer("POST", "/scheduler/filter", b"not json")
        assert (status, ctype) == (200, "application/json") and "not JSON" in json.loads(body)["error"]
        assert (await ext.answer("GET", "/scheduler/filter", b""))[0] == 404
        assert (await ext.answer("POST", "/metrics", b""))[0] == 404
        assert (await ext.answer("POST", "/scheduler/bind", b'{"podName": 1}'))[0] == 200

    asyncio.run(go())
