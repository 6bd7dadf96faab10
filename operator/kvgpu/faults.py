"""Expected faults of talking to the API server, told apart from bugs, and logged briefly.

An API server that restarts, a connection reset, a node deleted under its agent, a 409 from a
concurrent writer, a 5xx or a timeout are part of normal life: they are logged as one-line
warnings with the reason (:func:`expected`), at most once per ``every_s`` per place
(:class:`FaultLog`), and a line says when the place works again. Anything else is a bug and
keeps its traceback. Pure, except :class:`FaultLog`, which logs.
"""

from __future__ import annotations

import asyncio
import errno
import json
import time
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

#: HTTP statuses that are not bugs of the caller: gone (404, 410), a concurrent writer (409),
#: throttled or storage re-initialising (429), the API server or a proxy failing (5xx).
EXPECTED_STATUS = frozenset({404, 409, 410, 429, 500, 502, 503, 504})

_NET_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE,
                         errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.ENOTCONN})


def status_message(e: ApiException) -> str:
    """The human part of an API error: the ``message`` of the API server's Status body (with its
    ``reason`` and HTTP code), not the raw JSON. Falls back to the HTTP reason phrase."""
    code = e.status
    raw: Any = e.body if e.body else e.reason
    status: dict[str, Any] | None = None
    if isinstance(raw, bytes | str):
        try:
            doc = json.loads(raw)
            status = doc if isinstance(doc, dict) else None
        except ValueError:
            status = None
    if status is None and isinstance(e.reason, str):
        try:
            doc = json.loads(e.reason)
            status = doc if isinstance(doc, dict) else None
        except ValueError:
            status = None
    if status is not None:
        msg = str(status.get("message") or "").strip()
        why = str(status.get("reason") or "").strip()
        code = status.get("code") or code
        head = msg or why or "no message"
        tail = ", ".join(x for x in (why if msg else "", f"HTTP {code}" if code else "") if x)
        return f"{head} ({tail})" if tail else head
    phrase = str(e.reason or "").strip().splitlines()[0] if e.reason else ""
    return f"HTTP {code} {phrase}".strip() if code else (phrase or "API error")


def expected(e: BaseException) -> str | None:
    """A one-line reason when ``e`` is an expected fault of an API call (the API server away or
    restarting, a connection refused or reset, a timeout, HTTP 404/409/410/429/5xx); None when it
    is anything else (a bug: keep the traceback)."""
    if isinstance(e, ApiException):
        if e.status in EXPECTED_STATUS or not e.status:
            return status_message(e) if e.status else "no answer from the API server"
        return None
    if isinstance(e, aiohttp.ClientConnectorError):
        return f"cannot connect to {e.host}:{e.port} ({_os_reason(e.os_error)})"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the API server closed the connection"
    if isinstance(e, aiohttp.ClientPayloadError):
        return "the connection broke mid-answer"
    if isinstance(e, aiohttp.ServerTimeoutError | asyncio.TimeoutError | TimeoutError):
        return "timed out"
    if isinstance(e, aiohttp.ClientOSError | ConnectionError):
        return _os_reason(e)
    if isinstance(e, OSError) and e.errno in _NET_ERRNOS:
        return _os_reason(e)
    return None


def _os_reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return f"{e.strerror or errno.errorcode.get(e.errno, e.errno)}".lower()
    return str(e) or type(e).__name__


class FaultLog:
    """Rate-limited warnings for expected faults, per place (``key``).

    :meth:`fault` logs the first fault of a place at once, then at most one line per ``every_s``
    (with how many were not logged); :meth:`ok` logs one line when a place that failed works
    again. ``log`` is a structlog or stdlib logger (``warning``/``info`` with a message)."""

    def __init__(self, log: Any, every_s: float = 60.0, clock: Any = time.monotonic) -> None:
        self.log, self.every_s, self.clock = log, every_s, clock
        self._failing: dict[str, list[float]] = {}  # key -> [last logged at, faults not logged]

    def fault(self, key: str, what: str, reason: str) -> bool:
        """Note a fault of ``key``; True when a line was logged."""
        now = self.clock()
        st = self._failing.get(key)
        if st is not None and now - st[0] < self.every_s:
            st[1] += 1
            return False
        quiet = int(st[1]) if st is not None else 0
        self._failing[key] = [now, 0]
        more = f" ({quiet} more since the last warning)" if quiet else ""
        self.log.warning(f"{what}: {reason}{more}")
        return True

    def ok(self, key: str, what: str) -> bool:
        """Note a success of ``key``; True when it had failed (a recovery line was logged)."""
        if self._failing.pop(key, None) is None:
            return False
        self.log.info(f"{what}: working again")
        return True

    def failing(self, key: str) -> bool:
        return key in self._failing
