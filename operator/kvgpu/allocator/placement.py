"""Greedy placement of a pod on one node (:func:`_place`), its fast verdicts (:func:`_scan`,
:func:`_surely_fits`), the reasons a node does not fit (:func:`_why`, :func:`explain`) and the
check of a reservation against the node (:func:`_check`). Pure, no I/O; the rules are in
:mod:`kvgpu.allocator.ledger`'s docstring and :mod:`kvgpu.allocator.fit`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgpu.allocator import fit as F
from kvgpu.allocator.fit import CardState, Need, need
from kvgpu.allocator.node import _Node, _Pick
from kvgpu.allocator.usage import AllocationError, Footprint
from kvgpu.core.requests import (
    ContainerAllocation,
    DeviceGrant,
    PodAllocation,
    PodRequest,
    Policy,
)


def decide(node: _Node, needs: list[Need], pod: PodRequest, fast: bool) -> PodAllocation | str | None:
    """The pod's placement on ``node``, or why it does not fit. With ``fast`` a
    single-container pod that fits gives ``None`` (feasible, cards not chosen)."""
    got = _decide(node, needs, pod, fast)
    return got + node.over_note if isinstance(got, str) else got


def _decide(node: _Node, needs: list[Need], pod: PodRequest, fast: bool) -> PodAllocation | str | None:
    many = len(needs) > 1
    for n in needs:
        why = node.prefilter(n)
        if why is not None:
            return f"container {n.req.container!r}: {why}" if many else why
    if fast:
        if len(needs) == 1:
            return _scan(node, needs[0])  # exactly _place's verdict and reason
        if _surely_fits(node, needs):
            return None
    return _place(node, pod, needs)


def _place(node: _Node, pod: PodRequest, needs: list[Need]) -> PodAllocation | str:
    """Greedy placement of the whole pod; the allocation, or why it does not fit."""
    policy = Policy(pod.gpu_policy)
    extra: dict[str, list[int]] = {}  # this pod's app slices so far, per card
    grants: dict[int, tuple[_Pick, ...]] = {}
    many = len(needs) > 1
    for i, n in enumerate(needs):
        if n.req.init:
            continue
        picks = _pick(node, n, policy, extra, None)
        if isinstance(picks, str):
            return f"container {n.req.container!r}: {picks}" if many else picks
        grants[i] = picks
        for c, mem, cores in picks:
            e = extra.setdefault(c.uuid, [0, 0, 0, 0, 0])
            e[0] += 1
            e[1] += mem
            e[2] += cores
            e[3] = 1 if (e[3] or cores >= 100) else 0
            e[4] = 1
    # Collapsed footprint so far (app sums; init maxima are folded in as they are placed).
    cover: dict[str, list[int]] = {u: [e[0], e[1], e[2], e[3]] for u, e in extra.items()}
    for i, n in enumerate(needs):
        if not n.req.init:
            continue
        picks = _pick(node, n, policy, None, cover)
        if isinstance(picks, str):
            return f"container {n.req.container!r}: {picks}" if many else picks
        grants[i] = picks
        for c, mem, cores in picks:
            f = cover.setdefault(c.uuid, [0, 0, 0, 0])
            f[0] = max(f[0], 1)
            f[1] = max(f[1], mem)
            f[2] = max(f[2], cores)
            f[3] = 1 if (f[3] or cores >= 100) else 0
    return PodAllocation(
        pod_uid=pod.uid,
        node=node.name,
        containers=tuple(
            ContainerAllocation(
                container=n.req.container,
                devices=tuple(
                    DeviceGrant(c.uuid, c.index, c.model, mem, cores, c.mode) for c, mem, cores in grants[i]
                ),
                priority=n.req.priority,
                init=n.req.init,
            )
            for i, n in enumerate(needs)
        ),
    )


def _needs(pod: PodRequest) -> list[Need]:
    if not pod.containers:
        raise ValueError(f"pod {pod.key} requests no GPU slice")
    names = [c.container for c in pod.containers]
    if len(set(names)) != len(names):
        raise ValueError(f"pod {pod.key}: container names repeat")
    Policy(pod.node_policy)
    Policy(pod.gpu_policy)
    return [need(c) for c in pod.containers]


def _surely_fits(node: _Node, needs: list[Need]) -> bool:
    """Cheap sufficient test that :func:`_place` succeeds (no ordering, no grants built).

    One container: :func:`_enough` is exact. Several: every init container is placed against
    the node without this pod, so :func:`_enough` is exact for each. For the app containers
    (none with ``numa_bind``): if at least ``sum(cards)`` cards each fit every app container
    on their own, the greedy placement cannot fail, since container *k* always finds enough
    cards not touched by containers 1..k-1. Otherwise: unknown (False)."""
    if len(needs) == 1:
        return _enough(node, needs[0])
    apps = [n for n in needs if not n.req.init]
    for n in needs:
        if n.req.init and not _enough(node, n):
            return False
    if not apps:
        return True
    if any(n.req.numa_bind for n in apps):
        return False
    want = sum(n.cards for n in apps)
    k = 0
    for c in node.cards:
        for n in apps:
            if F.selectable(c, n) is not None or type(F.fit(c, n, None)) is not tuple:
                break
        else:
            k += 1
            if k >= want:
                return True
    return False


def _enough(node: _Node, n: Need) -> bool:
    """Single-container fast path: are there ``n.cards`` fitting cards (on one NUMA node when
    ``numa_bind``)? Equivalent to :func:`_pick` succeeding, without ordering."""
    return _scan(node, n) is None


def _scan(node: _Node, n: Need) -> str | None:
    """One pass over the cards for one container placed alone: None as soon as enough cards
    fit, else the same reason :func:`_pick` gives (without scoring any card)."""
    want = n.cards
    fails: list[tuple[int, CardState, list[int] | None]] = []
    selectable, fit = F.selectable, F.fit
    if not n.req.numa_bind:
        k = 0
        for c in node.cards:
            code = selectable(c, n)
            if code is None:
                r = fit(c, n, None)
                if type(r) is tuple:
                    k += 1
                    if k >= want:
                        return None
                    continue
                code = r  # type: ignore[assignment]
            fails.append((code, c, None))  # type: ignore[arg-type]
        return _why(node, n, k, fails, None)
    per: dict[int | None, int] = {}
    for c in node.cards:
        code = selectable(c, n)
        if code is None:
            r = fit(c, n, None)
            if type(r) is tuple:
                k = per.get(c.numa, 0) + 1
                if k >= want:
                    return None
                per[c.numa] = k
                continue
            code = r  # type: ignore[assignment]
        fails.append((code, c, None))  # type: ignore[arg-type]
    return _why(node, n, sum(per.values()), fails, max(per.values(), default=0))


def _pick(
    node: _Node,
    n: Need,
    policy: Policy,
    extra: dict[str, list[int]] | None,
    cover: dict[str, list[int]] | None,
) -> tuple[_Pick, ...] | str:
    """Choose ``n.cards`` distinct cards for one container, or say why not.

    ``extra``: this pod's app slices already placed (app containers); ``cover``: the pod's
    collapsed footprint (init containers, which prefer cards it already covers)."""
    fits: list[tuple[tuple[Any, ...], CardState, int, int]] = []
    fails: list[tuple[int, CardState, list[int] | None]] = []
    for c in node.cards:
        code = F.selectable(c, n)
        ex = extra.get(c.uuid) if extra else None
        if code is None:
            r = F.fit(c, n, ex)
            if type(r) is tuple:
                mem, cores = r
                key: tuple[Any, ...] = F.order_key(policy, F.card_score(c, ex, mem, cores), c)
                if cover is not None:
                    fp = cover.get(c.uuid)
                    covered = fp is not None and fp[1] >= mem and fp[2] >= cores and (fp[3] or cores < 100)
                    key = (0 if covered else 1, *key)
                fits.append((key, c, mem, cores))
                continue
            code = r  # type: ignore[assignment]
        fails.append((code, c, ex))  # type: ignore[arg-type]
    want = n.cards
    if not n.req.numa_bind:
        if len(fits) >= want:
            fits.sort(key=lambda t: t[0])
            return tuple((c, m, k) for _, c, m, k in fits[:want])
        return _why(node, n, len(fits), fails, None)
    groups: dict[int | None, list[tuple[tuple[Any, ...], CardState, int, int]]] = {}
    for t in fits:
        groups.setdefault(t[1].numa, []).append(t)
    best: tuple[Any, ...] | None = None
    chosen = None
    for numa in sorted(groups, key=lambda x: (x is None, x or 0)):
        g = sorted(groups[numa], key=lambda t: t[0])
        if len(g) < want:
            continue
        top = g[:want]
        rank = (tuple(sum(t[0][i] for t in top) for i in range(len(top[0][0]) - 1)),)
        if best is None or rank < best:
            best, chosen = rank, top
    if chosen is not None:
        return tuple((c, m, k) for _, c, m, k in chosen)
    most = max((len(g) for g in groups.values()), default=0)
    return _why(node, n, len(fits), fails, most)


def _why(
    node: _Node,
    n: Need,
    fitting: int,
    fails: list[tuple[int, CardState, list[int] | None]],
    numa_most: int | None,
) -> str:
    counts: dict[int, int] = {}
    most_free = -1
    for code, c, ex in fails:
        counts[code] = counts.get(code, 0) + 1
        if code == F.NO_MEMORY:
            used = c.mem + (ex[1] if ex else 0)
            most_free = max(most_free, c.mem_total - used)
    parts = []
    for code, k in sorted(counts.items()):
        s = f"{k} {F.PHRASES[code]}"
        if code == F.NO_MEMORY:
            s += f" (most free {max(0, most_free)} MiB)"
        parts.append(s)
    if numa_most is not None and fitting >= n.cards:
        parts.append(f"{fitting} fit but at most {numa_most} on one NUMA node")
    fit_txt = f"{fitting} of {len(node.cards)} cards fit"
    return f"needs {n.describe()}: {fit_txt}" + (f"; {', '.join(parts)}" if parts else "")


def explain(reasons: Mapping[str, str], limit: int = 5) -> str:
    """One line for an Event from :meth:`Ledger.filter`'s reasons: ``"node-a: ...; node-b:
    ...; and 12 more nodes"`` (sorted by node name, at most ``limit`` nodes named)."""
    names = sorted(reasons)
    shown = "; ".join(f"{n}: {reasons[n]}" for n in names[:limit])
    rest = len(names) - limit
    return shown + (f"; and {rest} more node{'s' if rest != 1 else ''}" if rest > 0 else "")


def _check(node: _Node, old: dict[str, Footprint], new: dict[str, Footprint]) -> None:
    """Raise :class:`AllocationError` unless replacing ``old`` by ``new`` keeps every card within
    capacity and exclusivity."""
    for uuid in sorted(new):
        c = node.by_uuid.get(uuid)
        if c is None:
            raise AllocationError(f"{node.name}: no card {uuid}")
        if c.unusable is not None:
            raise AllocationError(f"{node.name} card {c.index}: {F.PHRASES[c.unusable]}")
        o = old.get(uuid, (0, 0, 0, 0))
        f = new[uuid]
        others_pods = c.pods - (1 if uuid in old else 0)
        others_excl = c.excl - o[3]
        slots = c.slots - o[0] + f[0]
        mem = c.mem - o[1] + f[1]
        cores = c.cores - o[2] + f[2]
        where = f"{node.name} card {c.index}"
        if slots > c.slots_total:
            raise AllocationError(f"{where}: no free slot ({c.slots_total} slots)")
        if mem > c.mem_total:
            raise AllocationError(f"{where}: memory {mem} MiB > {c.mem_total} MiB")
        if cores > c.cores_total:
            raise AllocationError(f"{where}: cores {cores} % > {c.cores_total} %")
        if others_excl and f:
            raise AllocationError(f"{where}: held exclusively by another pod")
        if (f[3] or c.excl_mode) and others_pods:
            raise AllocationError(f"{where}: an exclusive slice needs the card idle")
