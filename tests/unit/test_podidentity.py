"""Which (pod, container) the kubelet is admitting: the pure rule and its feeder, without I/O.

The kubelet's answers are played by dicts: ``{(namespace, name): KubeletPod | None}`` the way
PodResources ``Get`` answers them (``None``: not in the kubelet's pod manager yet).
"""

from __future__ import annotations

import asyncio

import pytest
from kvgpu.agent.podidentity import KubeletPod, NotIdentified, PodIdentifier, identify, waiting_pods
from podhelpers import GPU, ctr, pod

NODE = "gpu-0"


def uuid(i):
    return f"GPU-{i:08d}-0000-0000-0000-000000000000"


def test_burst_of_30_pods_follows_the_kubelets_order():
    # 30 one-card pods bound at once; the newest is admitted first (creation order must not matter).
    pods = [
        pod(f"p{i}", [ctr("main", 1)], claims={"main": [uuid(i % 8)]}, created=f"2026-12-01T10:00:{59 - i:02d}Z")
        for i in range(30)
    ]
    order = [29 - i for i in range(30)]  # the kubelet's admission order: newest first, say
    served: set[tuple[str, str]] = set()
    for step, i in enumerate(order):
        known = {("default", f"p{j}"): KubeletPod() for j in order[: step + 1]}
        answers = {k: known.get(k) for k in waiting_pods(pods, NODE, GPU, served)}
        got = identify(pods, NODE, GPU, 1, served, answers)
        assert (got.pod, got.container, got.uuids, got.others) == (f"p{i}", "main", (uuid(i % 8),), ())
        served.add(got.key)
    assert waiting_pods(pods, NODE, GPU, served) == []


def test_init_then_app_containers_in_spec_order():
    p = pod(
        "job",
        [ctr("a", 2), ctr("nogpu"), ctr("c", 1)],
        init=[ctr("setup", 1)],
        claims={"setup": [uuid(0)], "a": [uuid(1), uuid(2)], "c": [uuid(3)]},
    )
    kub = {("default", "job"): KubeletPod()}
    served: set[tuple[str, str]] = set()
    for size, want in ((1, "setup"), (2, "a"), (1, "c")):
        got = identify([p], NODE, GPU, size, served, kub)
        assert got.container == want
        served.add(got.key)
    with pytest.raises(NotIdentified):
        identify([p], NODE, GPU, 1, served, kub)
    # The size must match the first unallocated container: a 2-device call is not "setup".
    with pytest.raises(NotIdentified):
        identify([p], NODE, GPU, 2, set(), kub)


def test_agent_restart_uses_the_kubelets_allocations():
    p = pod(
        "job",
        [ctr("a", 2), ctr("c", 1)],
        init=[ctr("setup", 1)],
        claims={"setup": [uuid(0)], "a": [uuid(1), uuid(2)], "c": [uuid(3)]},
    )
    # Nothing served by this (new) agent; the kubelet says "a" holds devices: "setup" (not listed,
    # not restartable) was allocated before it, so "c" is next.
    got = identify([p], NODE, GPU, 1, set(), {("default", "job"): KubeletPod(frozenset({"a"}))})
    assert got.container == "c"
    # A running pod whose containers all hold devices is never a candidate.
    running = pod("old", [ctr("main", 1)], claims={"main": [uuid(5)]}, phase="Running")
    with pytest.raises(NotIdentified):
        identify([running], NODE, GPU, 1, set(), {("default", "old"): KubeletPod(frozenset({"main"}))})


def test_pods_the_kubelet_does_not_know_other_nodes_and_terminal_pods_are_skipped():
    pods = [
        pod("unseen", [ctr("main", 1)], claims={"main": [uuid(0)]}, created="2026-01-01T00:00:00Z"),
        pod("elsewhere", [ctr("main", 1)], claims={"main": [uuid(1)]}, node="gpu-1"),
        pod("done", [ctr("main", 1)], claims={"main": [uuid(2)]}, phase="Failed"),
        pod("it", [ctr("main", 1)], claims={"main": [uuid(3)]}),
    ]
    assert waiting_pods(pods, NODE, GPU) == [("default", "unseen"), ("default", "it")]
    kub = {("default", "unseen"): None, ("default", "it"): KubeletPod()}
    assert identify(pods, NODE, GPU, 1, set(), kub).pod == "it"


def test_ambiguous_pods_take_the_oldest():
    pods = [
        pod("young", [ctr("main", 1)], claims={"main": [uuid(0)]}, created="2026-12-01T10:00:05Z"),
        pod("old", [ctr("main", 1)], claims={"main": [uuid(1)]}, created="2026-12-01T10:00:01Z"),
    ]
    kub = {("default", "young"): KubeletPod(), ("default", "old"): KubeletPod()}
    got = identify(pods, NODE, GPU, 1, set(), kub)
    assert (got.pod, got.others) == ("old", ("default/young",))


def test_pod_without_a_claim_is_identified_with_no_claim():
    # A pod in a namespace the webhooks never see asks for nvidia.com/gpu directly.
    p = pod("raw", [ctr("main", 1)], ns="kube-system")
    got = identify([p], NODE, GPU, 1, set(), {("kube-system", "raw"): KubeletPod()})
    assert (got.namespace, got.pod, got.claim, got.uuids) == ("kube-system", "raw", None, ())


def test_created_containers_count_as_allocated():
    p = pod("job", [ctr("a", 1), ctr("b", 1)], claims={"a": [uuid(0)], "b": [uuid(1)]})
    p["status"]["containerStatuses"] = [{"name": "a", "containerID": "containerd://abc"}]
    assert identify([p], NODE, GPU, 1, set(), {("default", "job"): KubeletPod()}).container == "b"


async def test_lagging_cache_polls_fresh_lists():
    p = pod("late", [ctr("main", 1)], claims={"main": [uuid(7)]})
    lists = 0

    async def fresh():
        nonlocal lists
        lists += 1
        return [p] if lists >= 3 else []

    async def lookup(ns, name):
        return KubeletPod()

    ident = PodIdentifier(NODE, GPU, cached=lambda: [], lookup=lookup, fresh=fresh, poll_interval_s=0.01)
    got = await ident.identify(1)
    assert (got.pod, got.uuids, lists) == ("late", (uuid(7),), 3)
    ident.mark_served(got)
    ident.poll_s = 0.05
    with pytest.raises(NotIdentified):  # served now: nothing waits any more
        await asyncio.wait_for(ident.identify(1), 5)
