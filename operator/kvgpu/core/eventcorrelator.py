"""Event correlation as client-go's recorder does it (``tools/record/events_cache.go``). Pure: no
I/O, the caller gives the time; the adapter is :class:`kvgpu.kube.EventRecorder`.

For each core/v1 Event body (``kvgpu.kube.event_body``) about to be posted,
:meth:`EventCorrelator.correlate` decides, in client-go's order:

1. **Aggregation.** Events alike but for their message (same source, involved object, type,
   reason, reporting controller and instance: :func:`aggregate_key`) are counted by distinct
   message over ``max_interval_s`` (600 s; a quiet interval starts over); from the
   ``max_events``-th (10) distinct message on, the event becomes one combined Event with the
   message ``"(combined from similar events): <message>"`` keyed by the aggregate key, so the
   next ones update it instead of each making a new object.
2. **Deduplication.** An event identical to one seen (:func:`event_key`: source, involved
   object, type, reason, message) within ``dedup_window_s`` (3600 s, kube-apiserver's default
   ``--event-ttl``: the Event object is gone after that) is a **patch** of that Event: ``count``
   one more, ``lastTimestamp`` now, ``firstTimestamp`` kept.
3. **Spam filter.** A token bucket per source and involved object (:func:`spam_key`; burst
   ``spam_burst`` 25, refilled at ``spam_qps`` 1/300 per second): an event without a token is
   **skipped** (its count is still kept, so the next patch carries it, as client-go's does).

Caches are LRUs of ``cache_size`` (4096) keys, as client-go's. Errors: none raised.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

COMBINED_PREFIX = "(combined from similar events): "


def _involved(body: dict[str, Any]) -> list[str]:
    o = body.get("involvedObject") or {}
    return [str(o.get(k) or "") for k in ("kind", "namespace", "name", "fieldPath", "uid", "apiVersion")]


def _source(body: dict[str, Any]) -> list[str]:
    s = body.get("source") or {}
    return [str(s.get("component") or ""), str(s.get("host") or "")]


def event_key(body: dict[str, Any]) -> str:
    """Identity of an event for deduplication (client-go's ``getEventKey``)."""
    fields = [*_source(body), *_involved(body), str(body.get("type") or ""), str(body.get("reason") or ""),
              str(body.get("message") or "")]
    return "\x00".join(fields)


def aggregate_key(body: dict[str, Any]) -> str:
    """Identity of similar events: all of :func:`event_key` but the message, with the reporting
    controller and instance (client-go's ``EventAggregatorByReasonFunc``)."""
    fields = [*_source(body), *_involved(body), str(body.get("type") or ""), str(body.get("reason") or ""),
              str(body.get("reportingComponent") or ""), str(body.get("reportingInstance") or "")]
    return "\x00".join(fields)


def spam_key(body: dict[str, Any]) -> str:
    """The spam filter's bucket: source and involved object (client-go's ``getSpamKey``)."""
    return "\x00".join([*_source(body), *_involved(body)])


def rfc3339(t: float) -> str:
    """``t`` (seconds since the epoch) as the API's second-precision UTC time."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass(frozen=True)
class Decision:
    """What to do with an event. ``create``: post ``body`` (then :meth:`EventCorrelator.created`
    with ``key`` and the name the API server gave); ``patch``: merge-patch Event ``name`` with
    ``patch`` (``count``, ``lastTimestamp``, ``message``); ``skip``: nothing (spam)."""

    action: Literal["create", "patch", "skip"]
    key: str
    body: dict[str, Any]
    name: str = ""
    patch: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Seen:
    count: int
    first: str
    last: float
    name: str = ""


@dataclass
class _Similar:
    messages: set[str]
    last: float


@dataclass
class _Bucket:
    tokens: float
    last: float


class _Lru(OrderedDict[str, Any]):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def put(self, key: str, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


@dataclass
class EventCorrelator:
    """See the module doc. Durations in seconds, ``spam_qps`` in tokens per second."""

    max_events: int = 10
    max_interval_s: float = 600.0
    dedup_window_s: float = 3600.0
    spam_burst: int = 25
    spam_qps: float = 1 / 300
    cache_size: int = 4096

    def __post_init__(self) -> None:
        if self.max_events < 1 or self.spam_burst < 1 or self.cache_size < 1 or self.spam_qps < 0:
            raise ValueError("max_events, spam_burst and cache_size must be >= 1, spam_qps >= 0")
        self._similar = _Lru(self.cache_size)
        self._seen = _Lru(self.cache_size)
        self._buckets = _Lru(self.cache_size)

    def correlate(self, body: dict[str, Any], now: float) -> Decision:
        """The decision for ``body`` (not changed) at ``now`` (seconds since the epoch)."""
        event, key = self._aggregate(body, now)
        decision = self._observe(event, key, now)
        if not self._allow(spam_key(body), now):
            return Decision("skip", key, event)
        return decision

    def created(self, key: str, name: str) -> None:
        """Record the name the API server gave the Event created for ``key``."""
        seen = self._seen.get(key)
        if seen is not None:
            seen.name = name

    def forget(self, key: str) -> None:
        """Forget ``key``'s Event (its create failed, or it is gone: the next one is created)."""
        self._seen.pop(key, None)

    def _aggregate(self, body: dict[str, Any], now: float) -> tuple[dict[str, Any], str]:
        akey = aggregate_key(body)
        rec = self._similar.get(akey)
        if rec is None or now - rec.last > self.max_interval_s:
            rec = _Similar(set(), now)
        rec.messages.add(str(body.get("message") or ""))
        rec.last = now
        self._similar.put(akey, rec)
        if len(rec.messages) < self.max_events:
            return body, event_key(body)
        rec.messages.pop()  # never grow past max_events
        combined = dict(body, message=(COMBINED_PREFIX + str(body.get("message") or ""))[:1024])
        return combined, akey

    def _observe(self, event: dict[str, Any], key: str, now: float) -> Decision:
        seen = self._seen.get(key)
        ts = rfc3339(now)
        if seen is not None and seen.name and now - seen.last <= self.dedup_window_s:
            seen.count += 1
            seen.last = now
            self._seen.put(key, seen)
            patch = {"count": seen.count, "lastTimestamp": ts, "message": event.get("message", "")}
            body = dict(event, count=seen.count, firstTimestamp=seen.first, lastTimestamp=ts)
            return Decision("patch", key, body, seen.name, patch)
        self._seen.put(key, _Seen(1, ts, now))
        return Decision("create", key, dict(event, count=1, firstTimestamp=ts, lastTimestamp=ts))

    def _allow(self, skey: str, now: float) -> bool:
        b = self._buckets.get(skey)
        if b is None:
            b = _Bucket(float(self.spam_burst), now)
        b.tokens = min(float(self.spam_burst), b.tokens + (now - b.last) * self.spam_qps)
        b.last = now
        self._buckets.put(skey, b)
        if b.tokens < 1:
            return False
        b.tokens -= 1
        return True
