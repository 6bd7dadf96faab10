"""The node agent's usage metrics as ``kubectl vgpu top`` reads them: the one place that knows
the agent's metric names (agent/exporter.py, docs/agent.md "Metrics"), so a rename is one edit.

:func:`parse` turns an agent's ``/metrics`` text into :class:`CardUse` rows, one per container
and card.
"""

from __future__ import annotations

from dataclasses import dataclass

MEMORY_USED = "kvgpu_container_memory_used_bytes"
MEMORY_LIMIT = "kvgpu_container_memory_limit_bytes"
SM_UTIL = "kvgpu_container_sm_utilization_percent"
CORE_LIMIT = "kvgpu_container_core_limit_percent"
REGION_ACTIVE = "kvgpu_container_region_active"
_VALUES = {MEMORY_USED: "used", MEMORY_LIMIT: "limit", SM_UTIL: "sm", CORE_LIMIT: "cores"}


@dataclass(frozen=True)
class CardUse:
    """One container's use of one card. Bytes and percent; ``used``/``sm`` None when the agent
    has not read the container's shim region (``kvgpu_container_region_active`` 0 or absent)."""

    node: str
    namespace: str
    pod: str
    container: str
    device_uuid: str
    device_index: str
    limit_bytes: float
    core_limit_percent: float
    used_bytes: float | None
    sm_percent: float | None


def parse(text: str) -> list[CardUse]:
    """Rows from Prometheus text (``prometheus_client``'s parser); raises ``ValueError`` for text
    that is not the Prometheus format."""
    from prometheus_client.parser import text_string_to_metric_families

    vals: dict[tuple[str, ...], dict[str, float]] = {}
    active: dict[tuple[str, str, str], bool] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            lb = s.labels
            ctr = (lb.get("namespace", ""), lb.get("pod", ""), lb.get("container", ""))
            if s.name == REGION_ACTIVE:
                active[ctr] = s.value > 0
            elif s.name in _VALUES:
                key = (lb.get("node", ""), *ctr, lb.get("device_uuid", ""), lb.get("device_index", ""))
                vals.setdefault(key, {})[_VALUES[s.name]] = s.value
    out = []
    for (node, ns, pod, name, uuid, index), v in sorted(vals.items()):
        seen = active.get((ns, pod, name), False)
        out.append(CardUse(node, ns, pod, name, uuid, index, v.get("limit", 0.0), v.get("cores", 0.0),
                           v.get("used") if seen else None, v.get("sm") if seen else None))
    return out
