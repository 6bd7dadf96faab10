"""HTTP/2 on the extender port, beside aiohttp's HTTP/1.1 (one port, chosen by TLS ALPN).

kube-scheduler's extender client is Go ``net/http`` with HTTP/2 allowed (client-go's
``SetTransportDefaults``) and two idle HTTP/1.1 connections per host. Its binds run many at once,
so over HTTP/1.1 nearly every bind dialled a new connection (~0.9 per GPU pod in a burst), each a
TLS handshake with a client-certificate check: ~1 ms of the operator's CPU and as much of
kube-scheduler's. Over HTTP/2 every call is a stream on one connection per extender entry.

The server is a plain :class:`asyncio.Protocol` over the ``h2`` state machine (the operator's own
loop, no framework: Hypercorn's stream bookkeeping made each call cost more the more binds were
in flight, docs/decisions.md). :func:`alpn_site` serves both protocols on one TLS port:
:class:`Switch` looks at the protocol the handshake chose and hands the connection to
:class:`H2Server` (``h2``) or to aiohttp's handler (anything else).

What a connection gets:

* the client identity is checked once, when the connection opens (the TLS layer already
  required a certificate the client CA signed): a certificate naming none of the allowed
  identities gets a GOAWAY and the connection closes, before any request is read;
* each request's body is collected (at most ``max_body`` bytes: 413 beyond) and handed with its
  method and path to ``handle``, which answers ``(status, content type, body)``; requests run
  concurrently as tasks, their answers sent as they finish;
* flow control both ways: received data is acknowledged as it is taken into the body; an answer
  larger than the peer's window waits for its window updates;
* a stream the client resets, or a connection that closes, drops its answers but lets its
  requests finish, as aiohttp does for HTTP/1.1: a bind cut off half-way would leave a claim
  without its Binding (kube-scheduler retries a bind that timed out; the retry finds it done).
"""

from __future__ import annotations

import asyncio
import ssl
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import structlog
from aiohttp import web

from kvgpu.extender.tls import identities

log = structlog.get_logger("kvgpu.extender.http2")

#: ``handle(method, path, body)`` → ``(status, content type, body)``.
Handler = Callable[[str, str, bytes], Awaitable[tuple[int, str, bytes]]]

ALPN_H2 = "h2"
ALPN_HTTP11 = "http/1.1"
#: Streams a client may keep open at once (kube-scheduler opens a new connection beyond it).
MAX_CONCURRENT_STREAMS = 1000
_CONFIG = h2.config.H2Configuration(client_side=False, header_encoding=None)


def offer_h2(ctx: ssl.SSLContext) -> None:
    """Offer HTTP/2 and HTTP/1.1 by ALPN on ``ctx`` (a client that offers neither gets HTTP/1.1)."""
    ctx.set_alpn_protocols([ALPN_H2, ALPN_HTTP11])


class _Stream:
    __slots__ = ("answer", "body", "method", "path", "task")

    def __init__(self, method: str, path: str) -> None:
        self.method = method
        self.path = path
        self.body = bytearray()
        self.task: asyncio.Task[None] | None = None
        self.answer: bytes | None = None  # the answer's body not sent yet (None: not answered)


class H2Server(asyncio.Protocol):
    """One HTTP/2 connection (server side). ``allowed``: the client identities to answer (CN or
    DNS/URI SAN of the verified certificate); None answers every client (tests only)."""

    def __init__(self, handle: Handler, allowed: Iterable[str] | None, max_body: int) -> None:
        self._handle = handle
        self._allowed = None if allowed is None else frozenset(allowed)
        self._max_body = max_body
        self._conn = h2.connection.H2Connection(_CONFIG)
        self._transport: Any = None  # asyncio's or uvloop's TLS transport
        self._streams: dict[int, _Stream] = {}
        self._running: set[asyncio.Task[None]] = set()  # asyncio keeps only weak references

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._conn.local_settings = h2.settings.Settings(
            client=False, initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS})
        self._conn.initiate_connection()
        if self._allowed is not None:
            names = identities(transport.get_extra_info("peercert"))
            if not names & self._allowed:
                log.warning("extender connection refused: client identity not allowed", identities=sorted(names))
                self._conn.close_connection(h2.errors.ErrorCodes.REFUSED_STREAM)
                self._flush()
                transport.close()
                self._transport = None
                return
        self._flush()

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            return
        try:
            events = self._conn.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            log.info("extender HTTP/2 connection closed: protocol error", error=str(e))
            self._flush()
            self.close()
            return
        for ev in events:
            self._event(ev)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._streams.clear()  # requests still running finish; their answers go nowhere

    # ---------------------------------------------------------------- events

    def _event(self, ev: Any) -> None:
        if isinstance(ev, h2.events.RequestReceived):
            headers = dict(ev.headers)
            self._streams[ev.stream_id] = _Stream(headers.get(b":method", b"").decode(),
                                                  headers.get(b":path", b"").decode())
        elif isinstance(ev, h2.events.DataReceived):
            self._conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            s = self._streams.get(ev.stream_id)
            if s is not None and s.task is None:
                s.body += ev.data
                if len(s.body) > self._max_body:
                    self._start(ev.stream_id, s, too_large=True)
        elif isinstance(ev, h2.events.StreamEnded):
            s = self._streams.get(ev.stream_id)
            if s is not None and s.task is None:
                self._start(ev.stream_id, s)
        elif isinstance(ev, h2.events.StreamReset):
            self._streams.pop(ev.stream_id, None)  # its request finishes; the answer goes nowhere
        elif isinstance(ev, h2.events.WindowUpdated):
            self._send_pending(ev.stream_id)
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.close()

    def _start(self, stream_id: int, s: _Stream, too_large: bool = False) -> None:
        s.task = asyncio.ensure_future(self._answer(stream_id, s, too_large))
        self._running.add(s.task)
        s.task.add_done_callback(self._running.discard)

    async def _answer(self, stream_id: int, s: _Stream, too_large: bool = False) -> None:
        if too_large:
            status, ctype, body = 413, "text/plain", b"request body too large"
        else:
            try:
                status, ctype, body = await self._handle(s.method, s.path, bytes(s.body))
            except Exception:  # a bug in a verb: answer 500, keep the connection
                log.exception("extender HTTP/2 request failed", path=s.path)
                status, ctype, body = 500, "text/plain", b"internal error"
        if self._transport is None or self._streams.get(stream_id) is not s:
            return  # the connection closed or the client reset the stream meanwhile
        try:
            self._conn.send_headers(stream_id, [(b":status", str(status).encode()),
                                                (b"content-type", ctype.encode()),
                                                (b"content-length", str(len(body)).encode())])
        except h2.exceptions.ProtocolError:  # the stream closed meanwhile (e.g. its connection ended)
            self._streams.pop(stream_id, None)
            return
        s.answer = body
        self._send_pending(stream_id)

    def _send_pending(self, stream_id: int) -> None:
        """Send what the flow-control windows allow of ``stream_id``'s answer (stream 0, a
        connection-wide window update: of every answered stream's); the last byte ends the stream."""
        for sid in list(self._streams) if stream_id == 0 else [stream_id]:
            s = self._streams.get(sid)
            if s is None or s.answer is None:
                continue
            try:
                self._send_answer(sid, s)
            except h2.exceptions.ProtocolError:  # the stream closed meanwhile
                self._streams.pop(sid, None)
        self._flush()

    def _send_answer(self, sid: int, s: _Stream) -> None:
        assert s.answer is not None
        while True:
            n = min(len(s.answer), self._conn.local_flow_control_window(sid), self._conn.max_outbound_frame_size)
            if n <= 0 and s.answer:
                return  # wait for a window update
            chunk, s.answer = s.answer[:n], s.answer[n:]
            if not s.answer:
                self._conn.send_data(sid, chunk, end_stream=True)
                del self._streams[sid]
                return
            self._conn.send_data(sid, chunk)

    # ---------------------------------------------------------------- output

    def _flush(self) -> None:
        out = self._conn.data_to_send()
        if out and self._transport is not None:
            self._transport.write(out)

    def close(self) -> None:
        """Close the connection (its requests' tasks are cancelled when it is gone)."""
        if self._transport is not None:
            self._transport.close()


class Switch(asyncio.Protocol):
    """Hands a new TLS connection to HTTP/2 or HTTP/1.1 by the protocol ALPN chose. asyncio
    and uvloop call ``connection_made`` once the handshake completed, so the choice is known."""

    def __init__(self, http1: Callable[[], asyncio.BaseProtocol], http2: Callable[[], asyncio.BaseProtocol],
                 on_http2: Callable[[], None] | None = None) -> None:
        self._http1 = http1
        self._http2 = http2
        self._on_http2 = on_http2

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sslobj = transport.get_extra_info("ssl_object")
        chosen = sslobj.selected_alpn_protocol() if sslobj is not None else None
        proto = self._http2() if chosen == ALPN_H2 else self._http1()
        if chosen == ALPN_H2 and self._on_http2 is not None:
            self._on_http2()
        transport.set_protocol(proto)
        proto.connection_made(transport)


class ALPNSite(web.TCPSite):
    """aiohttp's TCP site with HTTP/2 beside HTTP/1.1 on the same TLS port (:class:`Switch`);
    ``on_http2`` is called for each connection that chose HTTP/2 (the operator counts them)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, ssl_context: ssl.SSLContext,
                 handle: Handler, allowed: Iterable[str] | None, max_body: int,
                 on_http2: Callable[[], None] | None = None) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self._on_http2 = on_http2
        self._h2_args = (handle, None if allowed is None else tuple(allowed), max_body)
        self._h2_conns: weakref.WeakSet[H2Server] = weakref.WeakSet()

    def _new_h2(self) -> H2Server:
        proto = H2Server(*self._h2_args)
        self._h2_conns.add(proto)
        return proto

    async def start(self) -> None:
        await web.BaseSite.start(self)
        http1 = self._runner.server
        assert http1 is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: Switch(http1, self._new_h2, self._on_http2), self._host, self._port, ssl=self._ssl_context,
            backlog=self._backlog, reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        for proto in list(self._h2_conns):
            proto.close()
        await super().stop()
