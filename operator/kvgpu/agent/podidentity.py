"""Which (pod, container) the kubelet is admitting while it calls the device plugin.

The device-plugin API carries no pod identity. It is recovered deterministically from how the
kubelet admits pods (``HandlePodAdditions``): one pod at a time, ``podManager.AddPod(pod)`` and then
``canAdmitPod``, whose device manager calls ``GetPreferredAllocation``/``Allocate`` once per
container requesting the resource — init containers first, then app containers, in spec order —
and records the devices in its ``podDevices`` only after ``Allocate`` returned. So, during such a
call, the container being admitted is **the first container, in spec order, requesting the
resource and not yet allocated, of a pod the kubelet knows** (PodResources v1 ``Get(namespace,
name)`` succeeds only for pods in its pod manager). Pods the agent's watch shows on this node but
the kubelet has not added yet are ruled out by ``Get`` answering "not found"; pods already admitted
by their containers holding devices (PodResources lists app containers and restartable init
containers), or by this plugin having served them (:attr:`PodIdentifier.served`).

:func:`identify` is that rule as a pure function; :class:`PodIdentifier` feeds it (pod cache,
fresh API lists while the cache has no candidate, the kubelet's answers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgpu.core import claimstr, keys

log = logging.getLogger(__name__)

TERMINAL_PHASES = ("Succeeded", "Failed")


class NotIdentified(LookupError):
    """No container of a pod the kubelet knows waits for ``size`` devices of the resource."""


@dataclass(frozen=True)
class KubeletPod:
    """The kubelet's answer for one pod: ``allocated`` = names of its containers holding devices of
    the resource (PodResources lists app containers and restartable init containers only)."""

    allocated: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Admitted:
    """The identified container. ``claim``: its ``KVGPU_CLAIM`` annotation text (``None``: the pod
    has no kvgpu claim for it). ``uuids``: its claimed cards (devices annotation, else the claim
    string's cards). ``others``: ``namespace/name`` of pods that were equally possible (the oldest
    won). ``run_as``: the container's user and group from its and its pod's securityContext
    (``runAsUser``, ``runAsGroup``, else ``fsGroup``), ``None`` where the spec leaves it to the image."""

    namespace: str
    pod: str
    uid: str
    container: str
    claim: str | None
    uuids: tuple[str, ...]
    others: tuple[str, ...] = ()
    run_as: tuple[int | None, int | None] = (None, None)

    @property
    def key(self) -> tuple[str, str]:
        return (self.uid, self.container)

    def __str__(self) -> str:
        return f"pod {self.namespace}/{self.pod} container {self.container}"


def _quantity(v: Any) -> int:
    """An extended-resource quantity (integers only: ``"2"``, ``2``); anything else is 0."""
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return 0


def requested(container: Mapping[str, Any], resource: str) -> int:
    """How many ``resource`` devices a container asks for (limits, else requests, as the kubelet)."""
    res = container.get("resources") or {}
    for part in ("limits", "requests"):
        q = (res.get(part) or {}).get(resource)
        if q is not None:
            return _quantity(q)
    return 0


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return pod.get("metadata") or {}


def _started(pod: Mapping[str, Any]) -> set[str]:
    st = pod.get("status") or {}
    return {
        str(cs.get("name"))
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or [])
        if cs.get("containerID") or (cs.get("state") or {}).get("running") or (cs.get("state") or {}).get("terminated")
    }


def _containers(pod: Mapping[str, Any], resource: str) -> list[tuple[str, int, bool]]:
    """``(name, quantity, is_init)`` of the pod's containers requesting ``resource``, spec order."""
    spec = pod.get("spec") or {}
    out = []
    for init, group in ((True, spec.get("initContainers") or []), (False, spec.get("containers") or [])):
        for c in group:
            q = requested(c, resource)
            if q > 0:
                out.append((str(c.get("name", "")), q, init))
    return out


def waiting_pods(
    pods: Iterable[Mapping[str, Any]], node: str, resource: str, served: Iterable[tuple[str, str]] = ()
) -> list[tuple[str, str]]:
    """``(namespace, name)`` of this node's live pods with a container requesting ``resource`` that
    neither this plugin served nor the runtime created — the pods worth asking the kubelet about."""
    done = set(served)
    out = []
    for p in pods:
        m = _meta(p)
        if (p.get("spec") or {}).get("nodeName") != node or (p.get("status") or {}).get("phase") in TERMINAL_PHASES:
            continue
        uid, started = str(m.get("uid", "")), _started(p)
        if any((uid, n) not in done and n not in started for n, _, _ in _containers(p, resource)):
            out.append((str(m.get("namespace", "")), str(m.get("name", ""))))
    return out


def claim_of(pod: Mapping[str, Any], container: str) -> tuple[str | None, tuple[str, ...]]:
    """The container's claim annotation text and card UUIDs (``(None, ())`` without a claim).

    UUIDs come from the devices annotation, else from the claim string; a claim string that does
    not decode counts as no claim (logged)."""
    ann = _meta(pod).get("annotations") or {}
    text = ann.get(keys.claim_annotation(container))
    if not text:
        return None, ()
    devs = [u for u in str(ann.get(keys.devices_annotation(container), "")).split(",") if u]
    if devs:
        return str(text), tuple(devs)
    try:
        return str(text), tuple(d.uuid for d in claimstr.decode(str(text)).devices)
    except claimstr.ClaimStringError as e:
        m = _meta(pod)
        log.warning("pod %s/%s container %s: bad claim annotation: %s", m.get("namespace"), m.get("name"), container, e)
        return None, ()


def identify(
    pods: Iterable[Mapping[str, Any]],
    node: str,
    resource: str,
    size: int,
    served: Iterable[tuple[str, str]],
    kubelet: Mapping[tuple[str, str], KubeletPod | None],
) -> Admitted:
    """The (pod, container) the kubelet is admitting for a call asking for ``size`` devices.

    ``pods``: API dicts (this node's; others are skipped). ``served``: ``(pod UID, container)``
    pairs this plugin already allocated. ``kubelet``: per ``(namespace, name)`` the kubelet's
    answer, ``None`` = not found (not being admitted); pods missing from the map are not known to
    be known, so skipped too. Per candidate pod (not terminal, on ``node``, known to the kubelet)
    the first container in spec order (init, then app) requesting ``resource`` that is neither
    served, nor holding devices per the kubelet, nor created is the one; an app container holding
    devices means every init container was allocated. The pod counts only when that container asks
    for exactly ``size``. Several pods left: the oldest ``creationTimestamp`` (then name) wins and
    :attr:`Admitted.others` names the rest. Raises :class:`NotIdentified` when none is left.
    """
    done = set(served)
    found: list[tuple[str, str, Mapping[str, Any], str]] = []
    for p in pods:
        m = _meta(p)
        key = (str(m.get("namespace", "")), str(m.get("name", "")))
        if (p.get("spec") or {}).get("nodeName") != node or (p.get("status") or {}).get("phase") in TERMINAL_PHASES:
            continue
        answer = kubelet.get(key)
        if answer is None:
            continue
        uid, started, wanted = str(m.get("uid", "")), _started(p), _containers(p, resource)
        app_allocated = any(not init and n in answer.allocated for n, _, init in wanted)
        first = next(
            (
                (n, q)
                for n, q, init in wanted
                if (uid, n) not in done
                and n not in answer.allocated
                and n not in started
                and not (init and app_allocated)
            ),
            None,
        )
        if first is not None and first[1] == size:
            found.append((str(m.get("creationTimestamp") or ""), key[1], p, first[0]))
    if not found:
        raise NotIdentified(f"no pod the kubelet knows on {node} waits for {size} {resource}")
    found.sort(key=lambda f: (f[0], f[1]))
    _, _, pod, container = found[0]
    m = _meta(pod)
    claim, uuids = claim_of(pod, container)
    others = tuple(f"{_meta(f[2]).get('namespace')}/{f[1]}" for f in found[1:])
    return Admitted(
        str(m.get("namespace", "")), str(m.get("name", "")), str(m.get("uid", "")), container, claim, uuids, others,
        run_as_of(pod, container),
    )


def run_as_of(pod: Mapping[str, Any], container: str) -> tuple[int | None, int | None]:
    """``(uid, gid)`` the container runs as according to its spec (container securityContext over
    the pod's; the group falls back to ``fsGroup``); ``None`` where the image decides."""
    spec = pod.get("spec") or {}
    psc = spec.get("securityContext") or {}
    csc: Mapping[str, Any] = {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if c.get("name") == container:
            csc = c.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup", psc.get("fsGroup")))
    return (None if uid is None else int(uid), None if gid is None else int(gid))


# --------------------------------------------------------------------------- feeding it

PodLister = Callable[[], Awaitable[Sequence[Mapping[str, Any]]]]
KubeletLookup = Callable[[str, str], Awaitable[KubeletPod | None]]
KubeletLookupMany = Callable[[Sequence[tuple[str, str]]], Awaitable[Mapping[tuple[str, str], KubeletPod | None]]]


@dataclass
class PodIdentifier:
    """Identifies the container being admitted from the agent's pod cache and the kubelet.

    ``cached()``: the pod cache's pods now; ``fresh``: an API list of this node's pods (used while
    the cache has no candidate: the agent's watch can lag the kubelet's), polled every
    ``poll_interval_s`` for up to ``poll_s``; ``lookup``: the kubelet's answer per pod
    (:meth:`~kvgpu.agent.podresources.PodResourcesClient.lookup`); ``lookup_many``, where given,
    answers for every waiting pod in one call instead (the kubelet rate-limits PodResources: one
    call per waiting pod in a burst is refused). ``served`` remembers allocated
    ``(pod UID, container)`` pairs (:meth:`mark_served`), forgotten after ``forget_s``.
    """

    node: str
    resource: str
    cached: Callable[[], Sequence[Mapping[str, Any]]]
    lookup: KubeletLookup
    fresh: PodLister | None = None
    lookup_many: KubeletLookupMany | None = None
    poll_s: float = 5.0
    poll_interval_s: float = 0.25
    forget_s: float = 3600.0
    served: dict[tuple[str, str], float] = field(default_factory=dict)

    def mark_served(self, admitted: Admitted) -> None:
        now = time.monotonic()
        self.served[admitted.key] = now
        for k, t in list(self.served.items()):
            if now - t > self.forget_s:
                del self.served[k]

    async def _once(self, pods: Sequence[Mapping[str, Any]], size: int) -> Admitted:
        asks = waiting_pods(pods, self.node, self.resource, self.served)
        if self.lookup_many is not None:
            answers = dict(await self.lookup_many(asks))
        else:
            answers = dict(zip(asks, await asyncio.gather(*(self.lookup(ns, n) for ns, n in asks)), strict=True))
        return identify(pods, self.node, self.resource, size, self.served, answers)

    async def identify(self, size: int) -> Admitted:
        """The container being admitted for ``size`` devices. Raises :class:`NotIdentified` after
        ``poll_s`` of fresh lists without one; errors of ``lookup``/``fresh`` propagate."""
        try:
            got = await self._once(self.cached(), size)
        except NotIdentified:
            if self.fresh is None:
                raise
            deadline = time.monotonic() + self.poll_s
            while True:
                try:
                    got = await self._once(await self.fresh(), size)
                    break
                except NotIdentified:
                    if time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(self.poll_interval_s)
        if got.others:
            log.warning("%s and %s are both being admitted as far as the kubelet shows; took the oldest, %s",
                        got, ", ".join(got.others), got.pod)
        return got
