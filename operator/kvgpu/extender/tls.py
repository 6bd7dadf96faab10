"""Mutual TLS for the scheduler extender (issue 14).

filter/prioritize/bind decide where GPU pods run and make the operator write Bindings and Events,
so only kube-scheduler may call them. The extender port serves HTTPS and requires a client
certificate signed by ``--extender-client-ca`` (``ssl.CERT_REQUIRED``: a client without one
fails the TLS handshake, so no request is read). A verified certificate must also name an
allowed identity (``--extender-allowed-clients``: the subject CN or a DNS/URI SAN, default
:data:`DEFAULT_ALLOWED_CLIENTS`), else every path answers 403. kubelet probes and Prometheus
use a separate plain port (``--metrics-address``: ``/healthz``, ``/readyz``, ``/metrics`` only).

Certificates are re-read when their files change (cert-manager renewals), checked every
:data:`RELOAD_INTERVAL_S`; handshakes after a reload use the new files. CAs are only ever
added to the trust store (an SSLContext cannot drop one): a removed CA stays trusted until the
operator restarts.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

log = structlog.get_logger("kvgpu.extender.tls")

DEFAULT_ALLOWED_CLIENTS = ("kvgpu-scheduler",)
RELOAD_INTERVAL_S = 10.0


def server_context(cert: str, key: str, client_ca: str, *,
                   on_handshake: Callable[[], None] | None = None) -> ssl.SSLContext:
    """TLS >= 1.2 server context that requires a client certificate signed by ``client_ca``.
    ``on_handshake`` is called after each completed handshake (each new connection: the
    operator counts them, ``kvgpu_extender_connections_total``).

    No session tickets: kube-scheduler's extender client (Go ``net/http`` without a
    ``ClientSessionCache``) never resumes a session. The runtime adds ALPN (HTTP/2 and HTTP/1.1,
    :func:`kvgpu.extender.http2.offer_h2`): over HTTP/2 kube-scheduler makes every call a stream
    of one connection per extender entry; over HTTP/1.1 it keeps at most 2 idle connections
    (Go's ``DefaultMaxIdleConnsPerHost``) and dials one for every call that finds none idle,
    about 0.85 handshakes per GPU pod in a burst. Issuing the two TLS 1.3 tickets OpenSSL sends
    by default was ~30 % of the server's CPU per handshake (0.35 of 1.2 ms with the
    client-certificate check)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=client_ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.num_tickets = 0  # TLS 1.3
    ctx.options |= ssl.OP_NO_TICKET  # TLS 1.2
    ctx.load_cert_chain(cert, key)
    if on_handshake is not None:
        ctx.sslobject_class = _handshake_hook(on_handshake)
    return ctx


def _handshake_hook(on_handshake: Callable[[], None]) -> type[ssl.SSLObject]:
    """An ``SSLObject`` class that calls ``on_handshake`` once its handshake completed. asyncio's
    and uvloop's TLS transports make their ``SSLObject`` through ``SSLContext.wrap_bio``, which
    builds ``SSLContext.sslobject_class`` (the documented way to give a context its own class)."""

    class Hooked(ssl.SSLObject):
        def do_handshake(self) -> None:
            super().do_handshake()  # raises SSLWantReadError until the client's last flight
            on_handshake()

    return Hooked


def identities(peercert: dict[str, Any] | None) -> set[str]:
    """The names a verified peer certificate (``SSLObject.getpeercert()``) claims: its subject
    common names and its DNS and URI subject alternative names."""
    if not peercert:
        return set()
    out = {value for rdn in peercert.get("subject", ()) for attr, value in rdn if attr == "commonName"}
    out |= {value for kind, value in peercert.get("subjectAltName", ()) if kind in ("DNS", "URI")}
    return out


def parse_allowed(values: Iterable[str]) -> tuple[str, ...]:
    """``--extender-allowed-clients`` values (repeatable, each may be comma-separated)."""
    out = tuple(dict.fromkeys(v.strip() for item in values for v in item.split(",") if v.strip()))
    return out or DEFAULT_ALLOWED_CLIENTS


def require_client(allowed: Iterable[str]) -> Callable[..., Awaitable[web.StreamResponse]]:
    """aiohttp middleware: 401 without a verified client certificate (not reachable with
    ``CERT_REQUIRED``; kept as a second line), 403 when it names none of ``allowed``."""
    allowed_set = frozenset(allowed)

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        transport = request.transport
        peer = transport.get_extra_info("peercert") if transport is not None else None
        if not peer:
            return web.json_response({"error": "a client certificate is required"}, status=401)
        names = identities(peer)
        if not names & allowed_set:
            log.warning("extender call refused: client identity not allowed", identities=sorted(names),
                        path=request.path)
            return web.json_response({"error": "client certificate identity not allowed"}, status=403)
        return await handler(request)

    return middleware


@dataclass
class Reloader:
    """Re-load the serving certificate and the client CA into ``ctx`` when their files change."""

    ctx: ssl.SSLContext
    cert: str
    key: str
    client_ca: str
    _seen: tuple[float, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        self._seen = self._mtimes()

    def _mtimes(self) -> tuple[float, ...]:
        out = []
        for p in (self.cert, self.key, self.client_ca):
            try:
                out.append(Path(p).stat().st_mtime)
            except OSError:
                out.append(-1.0)
        return tuple(out)

    def check(self) -> bool:
        """Reload if a file changed. Returns True when it reloaded."""
        now = self._mtimes()
        if now == self._seen or -1.0 in now:
            return False
        try:
            self.ctx.load_cert_chain(self.cert, self.key)
            self.ctx.load_verify_locations(cafile=self.client_ca)
        except (OSError, ssl.SSLError, ValueError) as e:  # a half-written renewal: try again next time
            log.warning("extender certificates not reloaded", error=str(e))
            return False
        self._seen = now
        log.info("extender certificates reloaded", cert=self.cert, client_ca=self.client_ca)
        return True

    async def run(self, interval_s: float = RELOAD_INTERVAL_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(self.check)
