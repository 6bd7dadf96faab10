"""Who picks the node of a GPU pod: the extender's filter, or kube-scheduler's scoring. Pure.

kube-scheduler calls an extender's ``filter`` and then, when more than one node is left, runs
its own score plugins and the extender's ``prioritize`` and adds the weighted scores up
(``schedulePod`` in ``pkg/scheduler/schedule_one.go``: "When only one node after predicate,
just use it"). Both calls sit in its serial scheduling cycle, so each costs every pod of a
burst an HTTP round trip and the encoding of a few hundred node names.

With :data:`NodeChoice.EXTENDER` (the default) filter answers only the best node by the node
policy (the highest :meth:`kvgpu.allocator.Ledger.rank`, unrounded, rather than prioritize's
0..10), so kube-scheduler skips scoring and prioritize. The pod loses what kube-scheduler's
scores would have added among the nodes that fit its GPU request: least-allocated cpu and
memory, image locality, ``PreferNoSchedule`` taints, the cluster's default topology spread,
and other pods' affinity terms towards it (none of these is visible in the pod itself), and
kube-scheduler's random choice among equal scores (here: the first in its order). A pod that
states a preference of its own (:func:`scheduler_preferences`) still gets every fitting node,
so its preference counts. With :data:`NodeChoice.SCHEDULER` filter always answers every
fitting node and prioritize scores them; use it too when another filtering extender follows
kvgpu's (it would see a single node).

When kube-scheduler scores (either mode), a node's total is each score plugin's normalised
0..100 times its weight plus prioritize's 0..10 times 10 times the extender's weight
(``prioritizeNodes`` in ``pkg/scheduler/schedule_one.go``, v1.36.3). The kvgpu profile
(:mod:`kvgpu.extender.schedconfig`) weighs the preference plugins at 1000 x their defaults, so
the pod's preferences decide and prioritize's GPU score (binpack/spread) orders only the nodes
they score equal, with least-allocated cpu and memory and image locality below it (weight 1 each
against the extender's 5). With the
defaults, a whole preferred-affinity term (200 points) lost to binpack (up to 500) on a busy
cluster (issue 22).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any


class NodeChoice(enum.StrEnum):
    EXTENDER = "extender"  # filter answers the best node by the GPU policy (one round trip)
    SCHEDULER = "scheduler"  # filter answers every fitting node; kube-scheduler scores them


def scheduler_preferences(pod: Mapping[str, Any]) -> list[str]:
    """The soft scheduling preferences in ``pod["spec"]`` that kube-scheduler scores, as
    field paths: ``affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution``,
    the same for ``podAffinity`` and ``podAntiAffinity``, ``topologySpreadConstraints``
    with ``whenUnsatisfiable: ScheduleAnyway``, and ``resourceClaims`` (the DynamicResources
    plugin scores a claim's ``firstAvailable`` alternatives). Empty when there are none;
    malformed specs (admission lets only valid pods through, but the extender may see
    anything) count as none."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return []
    found: list[str] = []
    affinity = spec.get("affinity")
    if isinstance(affinity, Mapping):
        for kind in ("nodeAffinity", "podAffinity", "podAntiAffinity"):
            part = affinity.get(kind)
            if isinstance(part, Mapping) and part.get("preferredDuringSchedulingIgnoredDuringExecution"):
                found.append(f"affinity.{kind}.preferredDuringSchedulingIgnoredDuringExecution")
    spread = spec.get("topologySpreadConstraints")
    if isinstance(spread, list) and any(
        isinstance(c, Mapping) and c.get("whenUnsatisfiable") == "ScheduleAnyway" for c in spread
    ):
        found.append("topologySpreadConstraints (ScheduleAnyway)")
    if spec.get("resourceClaims"):
        found.append("resourceClaims")
    return found


def best_node(scores: Mapping[str, float]) -> str:
    """The node with the highest score; among equal scores the first in ``scores``' order
    (kube-scheduler sends the nodes starting at a different one each cycle, so ties do not
    all land on one node). Raises ``ValueError`` when ``scores`` is empty."""
    if not scores:
        raise ValueError("best_node: no nodes")
    return max(scores, key=scores.__getitem__)  # the first of equal maxima; a C loop over ~500 names
