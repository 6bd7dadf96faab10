"""Who picks a GPU pod's node (kvgpu.extender.choice): the pure rules, and filter over HTTP
answering one node, or every fitting node when the pod states soft preferences or the
operator runs with ``--node-choice scheduler``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvgpu.extender.choice import NodeChoice, best_node, scheduler_preferences

from tests.unit.extender_helpers import NODES, Harness

PREFERRED_NODE = {"preferredDuringSchedulingIgnoredDuringExecution": [
    {"weight": 100, "preference": {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}}]}
PREFERRED_POD = {"preferredDuringSchedulingIgnoredDuringExecution": [
    {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {}}}]}


@pytest.mark.parametrize(("spec", "found"), [
    ({}, []),
    ({"affinity": {"nodeAffinity": PREFERRED_NODE}},
     ["affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution"]),
    ({"affinity": {"podAffinity": PREFERRED_POD, "podAntiAffinity": PREFERRED_POD}},
     ["affinity.podAffinity.preferredDuringSchedulingIgnoredDuringExecution",
      "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution"]),
    # required terms are filters (kube-scheduler applies them before calling filter): no preference
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}},
                   "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}}, []),
    ({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]},
     []),
    ({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
                                    {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}]},
     ["topologySpreadConstraints (ScheduleAnyway)"]),
    ({"resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}]}, ["resourceClaims"]),
    # malformed specs are no preference, not an exception
    ({"affinity": "x", "topologySpreadConstraints": {"a": 1}}, []),
    ({"affinity": {"nodeAffinity": [1]}, "topologySpreadConstraints": [None, 3]}, []),
])
def test_scheduler_preferences(spec: dict[str, Any], found: list[str]) -> None:
    assert scheduler_preferences({"spec": spec}) == found


@pytest.mark.parametrize("pod", [{}, {"spec": None}, {"spec": []}])
def test_scheduler_preferences_without_a_spec(pod: dict[str, Any]) -> None:
    assert scheduler_preferences(pod) == []


@given(st.dictionaries(st.text(min_size=1, max_size=4), st.integers(0, 100), min_size=1))
def test_best_node_is_the_first_of_the_highest(scores: dict[str, int]) -> None:
    best = best_node(scores)
    top = max(scores.values())
    assert scores[best] == top
    assert best == next(n for n, s in scores.items() if s == top)


def test_best_node_of_nothing() -> None:
    with pytest.raises(ValueError):
        best_node({})


# ------------------------------------------------------------------ filter over HTTP
def _pod(uid: str, spec_extra: dict[str, Any] | None = None, policy: str = "binpack") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"p-{uid}", "namespace": "ns", "uid": uid, "labels": {"kvgpu.io/managed": "true"},
                         "annotations": {"kvgpu.io/gpumem": "3000", "kvgpu.io/node-policy": policy}},
            "spec": {"containers": [{"name": "main", "image": "x"}], **(spec_extra or {})}}


def _filter(h: Harness, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    status, data = h.post("filter", json.dumps({"pod": pod, "nodenames": names}).encode())
    assert status == 200 and not data.get("error"), data
    return dict(data)


def _use_n1(h: Harness) -> None:
    """A reservation on n1, so binpack prefers n1 and spread does not."""
    from kvgpu.api.requests import parse_pod

    req = parse_pod(_pod("held"), h.state.default_pool_spec())
    assert req is not None
    h.state.ledger.bind(req, "n1")


def test_filter_answers_the_best_node_by_the_node_policy(harness: Harness) -> None:
    _use_n1(harness)
    assert _filter(harness, _pod("a"), NODES)["nodenames"] == ["n1"]
    # spread: the emptiest, first in the order kube-scheduler sent
    assert _filter(harness, _pod("b", policy="spread"), ["n2", "n1", "n0"])["nodenames"] == ["n2"]
    assert _filter(harness, _pod("c", policy="spread"), ["n0", "n1", "n2"])["nodenames"] == ["n0"]


def test_filter_leaves_nodes_that_do_not_fit_with_their_reason(harness: Harness) -> None:
    _use_n1(harness)
    pod = _pod("a")
    pod["metadata"]["annotations"]["kvgpu.io/gpumem"] = "19000"  # fits only on the untouched cards
    data = _filter(harness, pod, [*NODES, "unknown"])
    assert data["nodenames"] == ["n1"]  # n1 still has one empty card and is the fullest
    assert set(data["failedAndUnresolvableNodes"]) == {"unknown"}


def test_filter_answers_every_fitting_node_when_the_pod_has_preferences(harness: Harness) -> None:
    _use_n1(harness)
    pod = _pod("a", {"affinity": {"nodeAffinity": PREFERRED_NODE}})
    assert _filter(harness, pod, NODES)["nodenames"] == NODES


def test_filter_answers_every_fitting_node_with_node_choice_scheduler(harness: Harness) -> None:
    _use_n1(harness)
    harness.ext.node_choice = NodeChoice.SCHEDULER
    assert _filter(harness, _pod("a"), NODES)["nodenames"] == NODES


def test_filter_passes_pods_without_gpu_request_everywhere(harness: Harness) -> None:
    pod = _pod("a")
    pod["metadata"]["annotations"] = {}
    assert _filter(harness, pod, NODES)["nodenames"] == NODES
