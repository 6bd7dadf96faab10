"""client-go's event correlation, pure: deduplication into one Event's count, aggregation of
similar events into a combined one, the spam filter's token bucket, the LRU."""

from __future__ import annotations

import pytest
from kvgpu.core.eventcorrelator import COMBINED_PREFIX, EventCorrelator, aggregate_key, event_key, spam_key
from kvgpu.kube import event_body

T0 = 1_800_000_000.0
POD = {"apiVersion": "v1", "kind": "Pod", "name": "nb", "namespace": "team", "uid": "u1"}


def ev(message: str = "card lost", reason: str = "Unenforced", obj: dict | None = None, type_: str = "Warning"):
    return event_body(obj or POD, "team", reason=reason, message=message, type_=type_, component="kvgpu-agent",
                      host="gpu-0")


def post(c: EventCorrelator, body, now: float, name: str = "nb.kvgpu-abc"):
    d = c.correlate(body, now)
    if d.action == "create":
        c.created(d.key, name)
    return d


def test_identical_events_patch_one_event_count():
    c = EventCorrelator()
    first = post(c, ev(), T0)
    assert (first.action, first.body["count"]) == ("create", 1)
    for i in range(2, 6):
        d = post(c, ev(), T0 + i)
        assert (d.action, d.name, d.patch["count"]) == ("patch", "nb.kvgpu-abc", i)
    assert d.body["firstTimestamp"] == "2027-01-15T08:00:00Z" and d.patch["lastTimestamp"] == "2027-01-15T08:00:05Z"


def test_keys_separate_what_client_go_separates():
    base = ev()
    assert event_key(ev("other")) != event_key(base) and aggregate_key(ev("other")) == aggregate_key(base)
    assert aggregate_key(ev(reason="X")) != aggregate_key(base)
    assert aggregate_key(ev(type_="Normal")) != aggregate_key(base)
    assert spam_key(ev(reason="X")) == spam_key(base)
    assert spam_key(ev(obj=dict(POD, name="nb2"))) != spam_key(base)


def test_a_create_not_yet_named_or_forgotten_is_created_again():
    c = EventCorrelator()
    d = c.correlate(ev(), T0)
    assert c.correlate(ev(), T0 + 1).action == "create", "no name recorded: nothing to patch"
    c.created(d.key, "n1")
    assert c.correlate(ev(), T0 + 2).action == "patch"
    c.forget(d.key)
    assert c.correlate(ev(), T0 + 3).action == "create"


def test_dedup_window_passed_creates_a_new_event():
    c = EventCorrelator(dedup_window_s=3600)
    post(c, ev(), T0)
    assert c.correlate(ev(), T0 + 3601).action == "create"


def test_similar_events_past_the_threshold_are_combined():
    c = EventCorrelator(max_events=3)
    decisions = [post(c, ev(f"msg {i}"), T0 + i, name=f"e{i}") for i in range(6)]
    assert [d.action for d in decisions[:2]] == ["create", "create"]
    assert decisions[2].action == "create" and decisions[2].body["message"] == COMBINED_PREFIX + "msg 2"
    assert decisions[2].key == aggregate_key(ev())
    # Later similar events, whatever their message, update the combined Event.
    assert [(d.action, d.name, d.patch["count"]) for d in decisions[3:]] == [("patch", "e2", 2), ("patch", "e2", 3),
                                                                             ("patch", "e2", 4)]
    assert decisions[5].patch["message"] == COMBINED_PREFIX + "msg 5"


def test_aggregation_starts_over_after_a_quiet_interval():
    c = EventCorrelator(max_events=2, max_interval_s=600)
    post(c, ev("a"), T0)
    assert post(c, ev("b"), T0 + 601).body["message"] == "b"


def test_spam_filter_token_bucket_per_source_and_object():
    c = EventCorrelator(spam_burst=3, spam_qps=0.1, max_events=100)
    got = [c.correlate(ev(f"m{i}"), T0).action for i in range(5)]
    assert got == ["create", "create", "create", "skip", "skip"]
    assert c.correlate(ev("x", obj=dict(POD, name="other", uid="u2")), T0).action == "create", "own bucket"
    assert c.correlate(ev("m9"), T0 + 10).action == "create", "one token back after 1/qps"
    assert c.correlate(ev("m10"), T0 + 10).action == "skip"


def test_skipped_repeats_still_count():
    c = EventCorrelator(spam_burst=2, spam_qps=0.01)
    post(c, ev(), T0)
    assert c.correlate(ev(), T0).action == "patch"
    assert c.correlate(ev(), T0).action == "skip"
    d = c.correlate(ev(), T0 + 100)
    assert (d.action, d.patch["count"]) == ("patch", 4)


def test_lru_bounds_the_caches():
    c = EventCorrelator(cache_size=2)
    for n in ("a", "b", "c"):
        post(c, ev(obj=dict(POD, name=n, uid=n)), T0, name=n)
    assert c.correlate(ev(obj=dict(POD, name="a", uid="a")), T0 + 1).action == "create", "evicted"
    assert c.correlate(ev(obj=dict(POD, name="c", uid="c")), T0 + 1).action == "patch"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_events"):
        EventCorrelator(max_events=0)
