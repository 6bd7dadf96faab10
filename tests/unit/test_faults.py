"""Expected faults vs bugs (kvgpu.faults), their rate-limited warnings, Kopf's quieted lines,
and the human text of a bind's API error."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from kvgpu import faults
from kvgpu.extender.binder import api_error_text
from kvgpu.kube import read_checked
from kvgpu.logs import quiet_kopf

STATUS = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
          "message": 'nodes "gpu-1" not found', "reason": "NotFound", "details": {"name": "gpu-1"}, "code": 404}


def api_error(status: int, body: dict[str, Any] | None = None) -> ApiException:
    """An ApiException as kvgpu.kube.read_checked makes it (the raw body as its reason)."""
    raw = json.dumps(body or {}).encode()
    e = ApiException(status=status, reason=raw.decode())
    e.body = raw
    return e


class FakeResp:
    def __init__(self, status: int, data: bytes) -> None:
        self.status, self.data = status, data

    async def read(self) -> bytes:
        return self.data

    def release(self) -> None:
        pass


def test_status_message_is_the_human_part() -> None:
    text = faults.status_message(api_error(404, STATUS))
    assert text == 'nodes "gpu-1" not found (NotFound, HTTP 404)'
    assert "{" not in text
    plain = ApiException(status=503, reason="Service Unavailable")
    assert faults.status_message(plain) == "HTTP 503 Service Unavailable"


def test_read_checked_error_reads_as_text() -> None:
    body = dict(STATUS, code=409, reason="Conflict",
                message='Operation cannot be fulfilled on pods/binding "p": pod p is already assigned to node "n"')
    with pytest.raises(ApiException) as ei:
        asyncio.run(read_checked(FakeResp(409, json.dumps(body).encode())))
    text = api_error_text(ei.value)
    assert text.startswith("Operation cannot be fulfilled") and "(Conflict, HTTP 409)" in text
    assert '"kind"' not in text and "{" not in text


@pytest.mark.parametrize("exc", [
    api_error(404, STATUS), api_error(409), api_error(410), api_error(429), api_error(500), api_error(503),
    ApiException(status=0, reason="no answer"),
    ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    OSError(errno.EHOSTUNREACH, "No route to host"),
    TimeoutError(), aiohttp.ServerTimeoutError(),
    aiohttp.ServerDisconnectedError(), aiohttp.ClientPayloadError("cut"),
    aiohttp.ClientOSError(errno.ECONNRESET, "reset"),
])
def test_expected_faults(exc: BaseException) -> None:
    why = faults.expected(exc)
    assert why and "\n" not in why and "{" not in why


@pytest.mark.parametrize("exc", [
    api_error(400), api_error(403), api_error(422), KeyError("x"), ValueError("bad"), TypeError("t"),
    AttributeError("a"), OSError(errno.ENOENT, "No such file"), ZeroDivisionError(),
])
def test_bugs_are_not_expected(exc: BaseException) -> None:
    assert faults.expected(exc) is None


class Recorder:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def warning(self, msg: str) -> None:
        self.lines.append(("warning", msg))

    def info(self, msg: str) -> None:
        self.lines.append(("info", msg))


def test_fault_log_rate_limits_and_says_recovered() -> None:
    now = [0.0]
    rec = Recorder()
    fl = faults.FaultLog(rec, every_s=60, clock=lambda: now[0])
    for _ in range(12):  # a fault every 5 s for a minute: one line
        assert fl.fault("refresh", "refresh failed", "connection refused") is (now[0] == 0.0)
        now[0] += 5
    assert len(rec.lines) == 1
    fl.fault("refresh", "refresh failed", "connection refused")  # 60 s on: one more, with the count
    assert rec.lines[-1] == ("warning", "refresh failed: connection refused (11 more since the last warning)")
    assert fl.ok("refresh", "refresh") and rec.lines[-1] == ("info", "refresh: working again")
    assert not fl.ok("refresh", "refresh") and len(rec.lines) == 3
    assert fl.fault("refresh", "refresh failed", "x")  # a new outage is told at once


def _record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_kopf_success_lines_are_debug_and_retries_warnings() -> None:
    ok = _record("kopf.objects", logging.INFO, "Handler 'register.<locals>.pool_event' succeeded.")
    assert quiet_kopf(ok) is logging.getLogger().isEnabledFor(logging.DEBUG)
    retry = _record("kopf._cogs.clients.watching", logging.ERROR,
                    "Request attempt #4/9 failed; will retry: GET https://x/apis -> APITooManyRequestsError")
    assert quiet_kopf(retry) and retry.levelno == logging.WARNING and retry.levelname == "WARNING"
    other = _record("kopf.objects", logging.ERROR, "Handler 'x' failed with an exception. Will retry.")
    assert quiet_kopf(other) and other.levelno == logging.ERROR
    assert quiet_kopf(_record("kvgpu.operator", logging.INFO, "Handler 'x' succeeded."))
