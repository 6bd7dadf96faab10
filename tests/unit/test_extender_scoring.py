"""kube-scheduler's arithmetic with the kvgpu profile (issue 22): soft preferences decide, the
extender's GPU score orders only what they leave equal.

The model follows ``prioritizeNodes`` in ``pkg/scheduler/schedule_one.go`` (v1.36.3): a node's
total is the sum over score plugins of the normalised 0..100 score times the plugin's weight,
plus the extender's 0..10 score times 10 (``MaxNodeScore / MaxExtenderPriority``) times the
extender's weight; the highest total wins."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvgpu.extender.protocol import priority_list
from kvgpu.extender.schedconfig import (
    OTHER_SCORE_PLUGINS,
    PREFERENCE_PLUGINS,
    check_preferences_first,
    scheduler_configuration,
)

# kube-scheduler's default score weights (pkg/scheduler/apis/config/v1/default_plugins.go),
# written out here independently of the code under test.
DEFAULTS = {"TaintToleration": 3, "NodeAffinity": 2, "PodTopologySpread": 2, "InterPodAffinity": 2,
            "DynamicResources": 2, "NodeResourcesFit": 1, "NodeResourcesBalancedAllocation": 1,
            "ImageLocality": 1, "VolumeBinding": 1, "PodGroupPodsCount": 1}
PREFS = ("TaintToleration", "NodeAffinity", "PodTopologySpread", "InterPodAffinity", "DynamicResources")
OTHERS = tuple(p for p in DEFAULTS if p not in PREFS)
CFG = scheduler_configuration("http://op:8888/scheduler")


def weights(cfg: dict[str, Any] = CFG) -> tuple[dict[str, int], int]:
    """The score weights the profile gives each plugin (defaults, overridden by score.enabled),
    and the extender's weight."""
    [prof] = cfg["profiles"]
    w = dict(DEFAULTS)
    for p in prof.get("plugins", {}).get("score", {}).get("enabled", []):
        w[p["name"]] = p.get("weight", 1)
    [ext] = [e for e in cfg["extenders"] if e.get("prioritizeVerb")]  # kube-scheduler weighs only it
    return w, ext["weight"]


def totals(plugin_scores: dict[str, dict[str, int]], gpu_score: dict[str, int]) -> dict[str, int]:
    """kube-scheduler's totals: ``plugin_scores`` normalised 0..100 per plugin and node,
    ``gpu_score`` the ledger's 0..100 (the extender answers it on the 0..10 scale)."""
    w, ext_w = weights()
    ext = {e["host"]: e["score"] for e in priority_list(gpu_score)}
    return {n: sum(w[p] * s[n] for p, s in plugin_scores.items()) + ext[n] * 10 * ext_w for n in gpu_score}


def winner(t: dict[str, int]) -> str:
    return max(t, key=lambda n: t[n])


def test_issue_22_preferred_node_affinity_on_a_busy_cluster() -> None:
    """Binpack, ``light`` 43 % and ``full`` 90 % used; the pod prefers ``light`` (weight 100:
    NodeAffinity normalises it to 100 there, 0 elsewhere). Before: 2 x 100 + 4 x 50 = 400
    against 9 x 50 = 450."""
    gpu = {"light": 43, "full": 90}
    assert winner(totals({"NodeAffinity": {"light": 100, "full": 0}}, gpu)) == "light"
    assert winner(totals({"NodeAffinity": {"light": 100, "full": 100}}, gpu)) == "full"  # left open: binpack
    assert winner(totals({}, gpu)) == "full"
    # even an idle preferred node against a full one, and cpu/memory least-allocated on its side
    t = totals({"NodeAffinity": {"idle": 100, "full": 0}, "NodeResourcesFit": {"idle": 0, "full": 100},
                "ImageLocality": {"idle": 0, "full": 100}}, {"idle": 0, "full": 100})
    assert winner(t) == "idle"


@pytest.mark.parametrize("plugin", PREFS)
def test_each_preference_outweighs_the_gpu_score_and_the_resource_plugins(plugin: str) -> None:
    gpu = {"a": 0, "b": 100}  # the extender's widest spread
    rest = {p: {"a": 0, "b": 100} for p in OTHERS}  # and every other plugin's, all against a
    t = totals({plugin: {"a": 1, "b": 0}, **rest}, gpu)  # one normalised point for a
    assert winner(t) == "a"


def test_the_gpu_score_still_outweighs_the_resource_plugins_when_preferences_tie() -> None:
    """Pods without preferences (``--node-choice scheduler``) keep binpack over least-allocated
    cpu and memory, image locality and balanced allocation, as before."""
    t = totals({"NodeAffinity": {"a": 0, "b": 0}, "NodeResourcesFit": {"a": 100, "b": 0},
                "NodeResourcesBalancedAllocation": {"a": 100, "b": 0}, "ImageLocality": {"a": 100, "b": 0}},
               {"a": 0, "b": 100})
    assert winner(t) == "b"


node_names = st.lists(st.sampled_from("abcdef"), min_size=2, max_size=6, unique=True)


@given(node_names.flatmap(lambda ns: st.tuples(
    st.just(ns),
    st.dictionaries(st.sampled_from(list(DEFAULTS)), st.fixed_dictionaries(
        {n: st.integers(0, 100) for n in ns}), max_size=len(DEFAULTS)),
    st.fixed_dictionaries({n: st.integers(0, 100) for n in ns}))))
def test_preferences_decide_and_the_gpu_score_orders_only_their_ties(
        case: tuple[list[str], dict[str, dict[str, int]], dict[str, int]]) -> None:
    nodes, scores, gpu = case
    w, _ = weights()
    t = totals(scores, gpu)
    pref = {n: sum(w[p] * s[n] for p, s in scores.items() if p in PREFS) for n in nodes}
    best = max(pref.values())
    # every node with the top total has the top preference score
    assert all(pref[n] == best for n in nodes if t[n] == max(t.values()))


def test_the_code_and_this_model_agree_on_the_plugins() -> None:
    assert set(PREFERENCE_PLUGINS) == set(PREFS)
    assert {**PREFERENCE_PLUGINS, **OTHER_SCORE_PLUGINS} == DEFAULTS


def test_a_heavier_extender_would_break_the_order() -> None:
    check_preferences_first()
    with pytest.raises(ValueError, match="does not outweigh"):
        check_preferences_first(extender_weight=100)


def test_no_cluster_default_spreading_in_the_profile() -> None:
    """At the preferences' weight the system-default spread of a ReplicaSet's pods would override
    the GPU node policy; only a pod's own constraints count."""
    [prof] = CFG["profiles"]
    [args] = [c["args"] for c in prof["pluginConfig"] if c["name"] == "PodTopologySpread"]
    assert args["defaultingType"] == "List" and not args.get("defaultConstraints")
