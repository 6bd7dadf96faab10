"""Which pool covers a card: selectors, device filters, specificity, conflicts, slicing."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvgpu.api.models import NodeSelector, VGPUPool
from kvgpu.api.pools import (
    card_matches,
    conflicts,
    covering_pool,
    defaults_pool,
    effective_slicing,
    node_matches,
    node_slicing,
    pool_conditions,
    specificity,
)
from kvgpu.core.inventory import Card, Slicing

H200 = Card(uuid="GPU-aaaa-0", index=0, model="NVIDIA H200", memory_mib=143771, sm_count=132)
A100 = Card(uuid="GPU-bbbb-1", index=1, model="NVIDIA A100-SXM4-80GB", memory_mib=81920, sm_count=108)
GPU_NODE = {"kvgpu.io/gpu-node": "true", "zone": "a"}


def pool(name: str, **spec: Any) -> VGPUPool:
    return VGPUPool.model_validate({"metadata": {"name": name}, "spec": spec})


@pytest.mark.parametrize(
    ("selector", "labels", "match"),
    [
        ({}, {}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "1"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
        ({"matchLabels": {"a": "1"}}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"}, True),
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
        ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {"a": "1"}, False),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"a": ""}, True),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {}, True),
        ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"a": "x"}, False),
        (
            {"matchLabels": {"b": "2"}, "matchExpressions": [{"key": "a", "operator": "Exists"}]},
            {"a": "1", "b": "3"},
            False,
        ),
    ],
)
def test_node_matches(selector: dict[str, Any], labels: dict[str, str], match: bool) -> None:
    assert node_matches(NodeSelector.model_validate(selector), labels) is match


@pytest.mark.parametrize(
    ("devices", "card", "match"),
    [
        ({}, H200, True),
        ({"models": ["h200"]}, H200, True),  # case-insensitive substring
        ({"models": ["H100", "A100"]}, H200, False),
        ({"models": ["A100"]}, A100, True),
        ({"uuids": ["GPU-aaaa-0"]}, H200, True),
        ({"uuids": ["GPU-aaaa-0"]}, A100, False),
        ({"indexes": [1]}, A100, True),
        ({"indexes": [1]}, H200, False),
        ({"models": ["H200"], "indexes": [1]}, H200, False),  # lists combine with AND
    ],
)
def test_device_filter(devices: dict[str, Any], card: Card, match: bool) -> None:
    cov = covering_pool([pool("p", devices=devices)], {}, card)
    assert (cov.pool is not None) is match


def test_no_pool_no_slicing() -> None:
    assert effective_slicing([], GPU_NODE, H200) is None
    assert effective_slicing([pool("p", nodeSelector={"matchLabels": {"zone": "b"}})], GPU_NODE, H200) is None


def test_effective_slicing_values() -> None:
    p = pool("inference", splitCount=20, memoryScaling=1.5, coreScaling=2)
    assert effective_slicing([p], GPU_NODE, H200) == Slicing("inference", 20, 1.5, 2.0, "hami-core")


def test_exclusive_mode_is_one_slice() -> None:
    s = effective_slicing([pool("x", mode="exclusive", splitCount=10)], {}, H200)
    assert s is not None and (s.split_count, s.mode) == (1, "exclusive")


def test_most_specific_wins() -> None:
    everything = pool("default")
    labelled = pool("labelled", nodeSelector={"matchLabels": {"zone": "a"}})
    by_model = pool("models", devices={"models": ["H200"]})
    by_index = pool("indexes", devices={"indexes": [0]})
    by_uuid = pool("uuids", devices={"uuids": ["GPU-aaaa-0"]})
    order = [everything, labelled, by_model, by_index, by_uuid]
    for i in range(len(order)):
        cov = covering_pool(order[: i + 1], GPU_NODE, H200)
        assert cov.pool is order[i] and cov.conflicts == ()
        # order of the input does not matter
        assert covering_pool(list(reversed(order[: i + 1])), GPU_NODE, H200).pool is order[i]
    assert specificity(by_uuid.spec) > specificity(by_index.spec) > specificity(by_model.spec)
    # on the A100 only the pools without a device filter apply
    assert covering_pool(order, GPU_NODE, A100).pool is labelled


def test_ties_conflict_and_first_name_wins() -> None:
    a = pool("b-pool", nodeSelector={"matchLabels": {"zone": "a"}})
    b = pool("a-pool", nodeSelector={"matchLabels": {"kvgpu.io/gpu-node": "true"}})
    cov = covering_pool([a, b], GPU_NODE, H200)
    assert cov.pool is b and cov.conflicts == ("b-pool",)
    got = conflicts([a, b, pool("c", devices={"models": ["A100"]})], [(GPU_NODE, [H200, A100]), ({}, [H200])])
    assert got == {"a-pool": frozenset({"b-pool"}), "b-pool": frozenset({"a-pool"})}


def test_node_slicing_and_dict_pools() -> None:
    body = {
        "apiVersion": "kvgpu.io/v1alpha1",
        "kind": "VGPUPool",
        "metadata": {"name": "h200"},
        "spec": {"devices": {"models": ["H200"]}, "splitCount": 4},
    }
    got = node_slicing([body], GPU_NODE, [H200, A100])
    assert got[H200.uuid] == Slicing("h200", 4) and got[A100.uuid] is None


def test_defaults_pool() -> None:
    assert defaults_pool([]).defaults.gpu == 1
    only = pool("only", defaults={"gpu": 2})
    assert defaults_pool([only]).defaults.gpu == 2
    dflt = pool("default", defaults={"gpu": 3})
    assert defaults_pool([only, dflt]).defaults.gpu == 3
    assert defaults_pool([only, pool("other")]).defaults.gpu == 1


def test_pool_conditions() -> None:
    t0, t1 = "2026-11-30T06:00:00Z", "2026-11-30T07:00:00Z"
    conds = pool_conditions(cards=8, healthy_cards=8, conflicts_with=["b"], generation=2, now=t0)
    ready, conflict = conds
    assert (ready.type, ready.status.value, ready.reason) == ("Ready", "True", "CardsCovered")
    assert (conflict.type, conflict.status.value) == ("Conflict", "True") and "b" in conflict.message
    again = pool_conditions(
        cards=8, healthy_cards=0, conflicts_with=["b"], generation=3, now=t1, previous=conds
    )
    assert again[0].status.value == "False" and again[0].reason == "NoHealthyCards"
    assert (
        again[0].last_transition_time == t1 and again[1].last_transition_time == t0
    )  # unchanged keeps its time
    none = pool_conditions(cards=0, healthy_cards=0, conflicts_with=[], generation=None, now=t0)
    assert none[0].reason == "NoCardsCovered" and none[1].status.value == "False"
    many = pool_conditions(
        cards=1, healthy_cards=1, conflicts_with=[f"p{i:03}" for i in range(500)], generation=1, now=t0
    )
    assert "and 490 more" in many[1].message and len(many[1].message) < 300


_POOL_SPECS = st.fixed_dictionaries(
    {},
    optional={
        "nodeSelector": st.fixed_dictionaries(
            {},
            optional={
                "matchLabels": st.dictionaries(
                    st.sampled_from(["zone", "kvgpu.io/gpu-node"]), st.sampled_from(["a", "true"]), max_size=2
                )
            },
        ),
        "devices": st.fixed_dictionaries(
            {},
            optional={
                "models": st.lists(st.sampled_from(["H200", "A100", "nvidia"]), max_size=2),
                "indexes": st.lists(st.integers(0, 2), max_size=2),
                "uuids": st.lists(st.sampled_from(["GPU-aaaa-0", "GPU-bbbb-1"]), max_size=1),
            },
        ),
    },
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_POOL_SPECS, min_size=0, max_size=5), st.randoms(use_true_random=False))
def test_coverage_does_not_depend_on_pool_order(specs: list[dict[str, Any]], rnd: Any) -> None:
    pools = [pool(f"p{i}", **s) for i, s in enumerate(specs)]
    shuffled = list(pools)
    rnd.shuffle(shuffled)
    for card in (H200, A100):
        a, b = covering_pool(pools, GPU_NODE, card), covering_pool(shuffled, GPU_NODE, card)
        assert (a.pool.name if a.pool else None) == (b.pool.name if b.pool else None)
        assert a.conflicts == b.conflicts
        if a.pool is not None:
            assert card_matches(a.pool.spec.devices, card)
            assert node_matches(a.pool.spec.node_selector, GPU_NODE)
            assert a.pool.name not in a.conflicts
