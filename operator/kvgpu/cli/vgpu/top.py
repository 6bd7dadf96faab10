"""``kubectl vgpu top``: per pod (or container) GPU memory used/limit and SM use/limit, from the
node agents' usage metrics (:mod:`kvgpu.cli.vgpu.agentmetrics`). Pure: rows, sorting, table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from .agentmetrics import CardUse

MIB = 1024 * 1024
UNKNOWN = "-"
SORT_KEYS = ("memory", "sm", "name", "node")


@dataclass(frozen=True)
class TopRow:
    """A pod (``container`` empty) or a container: cards by node index, memory in MiB (used is
    None while no shim region was read), SM use and limit in percent of a card (limit 0 = none),
    summed over its cards and containers."""

    namespace: str
    pod: str
    container: str
    node: str
    cards: tuple[str, ...]
    memory_used_mib: int | None
    memory_limit_mib: int
    sm_percent: float | None
    sm_limit_percent: float

    def cells(self, all_namespaces: bool, containers: bool) -> list[str]:
        used = UNKNOWN if self.memory_used_mib is None else str(self.memory_used_mib)
        sm = UNKNOWN if self.sm_percent is None else f"{self.sm_percent:g}"
        limit = f"{self.sm_limit_percent:g}" if self.sm_limit_percent else "none"
        c = [self.pod, *([self.container] if containers else []), self.node, ",".join(self.cards) or UNKNOWN,
             f"{used}/{self.memory_limit_mib}", f"{sm}/{limit}"]
        return [self.namespace, *c] if all_namespaces else c

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["cards"] = list(self.cards)
        return d


def headers(all_namespaces: bool, containers: bool) -> list[str]:
    h = ["POD", *(["CONTAINER"] if containers else []), "NODE", "GPU", "MEMORY(MiB) USED/LIMIT",
         "SM(%) USED/LIMIT"]
    return ["NAMESPACE", *h] if all_namespaces else h


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def rows(uses: Iterable[CardUse], *, containers: bool = False, namespace: str | None = None,
         sort: str = "memory") -> list[TopRow]:
    """Group ``uses`` per pod (or per container), in ``namespace`` only unless None. ``sort``:
    ``memory`` (used, highest first), ``sm`` (highest first), ``name``, ``node``; raises
    ``ValueError`` for another key."""
    if sort not in SORT_KEYS:
        raise ValueError(f"sort key {sort!r}: one of {', '.join(SORT_KEYS)}")
    groups: dict[tuple[str, str, str], list[CardUse]] = {}
    for u in uses:
        if namespace is None or u.namespace == namespace:
            groups.setdefault((u.namespace, u.pod, u.container if containers else ""), []).append(u)
    out = []
    for (ns, pod, ctr), us in groups.items():
        used: float | None = 0.0
        sm: float | None = 0.0
        for u in us:
            used, sm = _add(used, u.used_bytes), _add(sm, u.sm_percent)
        cards = tuple(sorted({u.device_index or u.device_uuid for u in us}, key=lambda s: (len(s), s)))
        out.append(TopRow(ns, pod, ctr, us[0].node, cards, None if used is None else int(used // MIB),
                          int(sum(u.limit_bytes for u in us) // MIB), sm, sum(u.core_limit_percent for u in us)))
    by_name = sorted(out, key=lambda r: (r.namespace, r.pod, r.container))
    if sort == "memory":
        return sorted(by_name, key=lambda r: -(r.memory_used_mib if r.memory_used_mib is not None else -1))
    if sort == "sm":
        return sorted(by_name, key=lambda r: -(r.sm_percent if r.sm_percent is not None else -1))
    if sort == "node":
        return sorted(by_name, key=lambda r: r.node)
    return by_name


def render(rs: Sequence[TopRow], all_namespaces: bool, containers: bool) -> list[list[str]]:
    return [r.cells(all_namespaces, containers) for r in rs]
