"""What a VGPUPool's status says beyond its counts: cards holding more than the pool's shape
allows (a pool shrunk under live claims), and pools in conflict, with the nodes. Pure.

* :func:`excess` — per pool, the cards whose slots, memory or cores in use exceed what the
  pool gives them now (``splitCount``, ``memoryScaling`` or ``coreScaling`` lowered while pods
  hold slices). The pods keep running (nothing is evicted); new pods wait until enough end.
* :func:`conflict_nodes` — per pool, the equally specific pools it ties with and on which nodes.
* :func:`invalid_conditions` — a pool the model refuses: Ready False, reason ``InvalidSpec``.
* :func:`conditions` — the pool's conditions: those of :func:`kvgpu.api.pools.pool_conditions`
  with the Conflict message naming the other pools and the nodes, Ready saying that a pool
  that lost every card to a conflict lost them (not "no card matches"), and ``Overcommitted``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvgpu.allocator.ledger import CardUsage, NodeUsage
from kvgpu.api.models import COND_CONFLICT, COND_READY, Condition, ConditionStatus, VGPUPool
from kvgpu.api.pools import covering_pool
from kvgpu.core.inventory import Card

COND_OVERCOMMITTED = "Overcommitted"  # VGPUPool: some cards hold more than the pool allows now
INVALID_SPEC = "InvalidSpec"  # Ready's reason for a pool valid for the CRD's schema, not the model
SHOWN = 5  # most nodes or cards a message names before "and N more"


@dataclass(frozen=True, slots=True)
class OverCard:
    node: str
    card: CardUsage

    def what(self) -> str:
        c, out = self.card, []
        if c.slots_used > c.slots_total:
            out.append(f"slots {c.slots_used}/{c.slots_total}")
        if c.memory_used_mib > c.memory_total_mib:
            out.append(f"memory {c.memory_used_mib}/{c.memory_total_mib} MiB")
        if c.cores_used > c.cores_total:
            out.append(f"cores {c.cores_used}/{c.cores_total}")
        return f"{self.node} card {c.index} ({', '.join(out)})"


def _over(c: CardUsage) -> bool:
    return c.slots_used > c.slots_total or c.memory_used_mib > c.memory_total_mib or c.cores_used > c.cores_total


def excess(usages: Iterable[NodeUsage]) -> dict[str, list[OverCard]]:
    """Per pool name, its cards that hold more than its shape allows (pools without any absent)."""
    out: dict[str, list[OverCard]] = {}
    for u in usages:
        for c in u.cards:
            if c.pool and c.usable and _over(c):
                out.setdefault(c.pool, []).append(OverCard(u.node, c))
    return out


def _names(xs: Iterable[str]) -> str:
    xs = sorted(set(xs))
    more = len(xs) - SHOWN
    return ", ".join(xs[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def overcommit_message(over: list[OverCard]) -> str:
    nodes = {o.node for o in over}
    pods = sum(o.card.pods for o in over)
    shown = "; ".join(o.what() for o in over[:SHOWN]) + (f"; and {len(over) - SHOWN} more" if len(over) > SHOWN else "")
    return (f"{len(over)} card(s) on {len(nodes)} node(s) ({_names(nodes)}) hold more than the pool's shape "
            f"allows now: {shown}. Their {pods} pod(s) keep running; new slices there wait until enough end")


def conflict_nodes(
    pools: Iterable[VGPUPool], nodes: Iterable[tuple[str, Mapping[str, str], Iterable[Card]]]
) -> dict[str, dict[str, set[str]]]:
    """Per pool, the pools it ties with (equally specific on some card) → the nodes where.
    ``nodes`` yields ``(name, labels, cards)``."""
    models = list(pools)
    out: dict[str, dict[str, set[str]]] = {}
    for name, labels, cards in nodes:
        for card in cards:
            cov = covering_pool(models, labels, card)
            if cov.pool is None or not cov.conflicts:
                continue
            group = [cov.pool.name, *cov.conflicts]
            for a in group:
                for b in group:
                    if a != b:
                        out.setdefault(a, {}).setdefault(b, set()).add(name)
    return out


def conflict_note(node: str, clash: Mapping[str, Mapping[str, set[str]]]) -> str:
    """The text a pod's scheduling failure reason gets on ``node`` when pools conflict there."""
    tied = sorted({p for p, others in clash.items() for where in others.values() if node in where})
    if not tied:
        return ""
    return (f" (equally specific VGPUPools {', '.join(tied)} conflict on this node's cards; "
            f"{tied[0]} applies: see their Conflict condition)")


def conditions(
    pool: str,
    base: list[Condition],
    *,
    clash: Mapping[str, set[str]],
    over: list[OverCard],
    generation: int | None,
    now: str,
    previous: Iterable[Condition] = (),
) -> list[Condition]:
    """``base`` (Ready and Conflict from pool_conditions) refined for ``pool`` and with
    ``Overcommitted``; ``clash``: other pool → nodes where they tie."""
    out: list[Condition] = []
    winner = min([pool, *clash]) if clash else pool
    for c in base:
        if c.type == COND_CONFLICT and clash:
            parts = "; ".join(f"{other} on {_names(nodes)}" for other, nodes in sorted(clash.items())[:SHOWN])
            more = len(clash) - SHOWN
            parts += f"; and {more} more pools" if more > 0 else ""
            msg = (f"equally specific pools cover the same cards: {parts}. {winner} takes them (the name that "
                   "sorts first wins); narrow a nodeSelector or device filter to resolve it")
            c = c.model_copy(update={"message": msg})
        if c.type == COND_READY and c.reason == "NoCardsCovered" and clash:
            nodes = set().union(*clash.values())
            c = c.model_copy(update={"reason": "LostConflict",
                        "message": (f"every card the pool matches is taken by the equally specific pool {winner} "
                                 f"(its name sorts first) on {_names(nodes)}: see the Conflict condition")})
        out.append(c)
    if over:
        status, reason, message = ConditionStatus.TRUE, "ShapeBelowUse", overcommit_message(over)
    else:
        status, reason, message = (ConditionStatus.FALSE, "WithinShape",
                                   "no card holds more than the pool's shape allows")
    old = next((c for c in previous if c.type == COND_OVERCOMMITTED), None)
    since = old.last_transition_time if old is not None and old.status == status else now
    out.append(Condition(type=COND_OVERCOMMITTED, status=status, reason=reason, message=message,
                         last_transition_time=since, observed_generation=generation))
    return out


def invalid_conditions(why: str, *, generation: int | None, now: str,
                       previous: Iterable[Condition] = ()) -> list[Condition]:
    """The conditions of a pool the operator's model refuses: Ready False, reason InvalidSpec."""
    old = next((c for c in previous if c.type == COND_READY), None)
    since = (old.last_transition_time if old is not None and old.status == ConditionStatus.FALSE
             and old.reason == INVALID_SPEC else now)
    return [Condition(type=COND_READY, status=ConditionStatus.FALSE, reason=INVALID_SPEC,
                      message=(f"the spec is invalid: {why}. The pool slices no cards until it is fixed; "
                               "pods holding slices keep them")[:32768],
                      last_transition_time=since, observed_generation=generation)]


def became_overcommitted(previous: Iterable[Condition], now: list[Condition]) -> Condition | None:
    """The new Overcommitted condition when it turned True (for the pool's Event), else None."""
    old = next((c for c in previous if c.type == COND_OVERCOMMITTED), None)
    new = next((c for c in now if c.type == COND_OVERCOMMITTED), None)
    if new is None or new.status != ConditionStatus.TRUE:
        return None
    if old is not None and old.status == ConditionStatus.TRUE and old.message == new.message:
        return None
    return new if old is None or old.status != ConditionStatus.TRUE else None


def in_use(pool: str, usages: Iterable[NodeUsage]) -> tuple[int, list[str]]:
    """(pods with slices, nodes) on the cards ``pool`` covers: what its deletion leaves behind."""
    pods, nodes = 0, []
    for u in usages:
        n = sum(c.pods for c in u.cards if c.pool == pool)
        if n:
            pods += n
            nodes.append(u.node)
    return pods, nodes


def deleted_in_use_message(pool: str, pods: int, nodes: list[str]) -> str:
    return (f"VGPUPool {pool} deleted while {pods} pod(s) hold slices of its cards on {_names(nodes)}: they keep "
            "running and their claims keep the cards; the cards take no new slices until a pool covers them again")
