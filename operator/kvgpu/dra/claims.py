"""What an allocated ``resource.k8s.io/v1`` ResourceClaim gives a container on this node: the
kvgpu claim string the shim enforces. Pure: the kubelet plugin (:mod:`kvgpu.agent.draplugin`)
reads the claim and the inventory and calls :func:`prepare_claim`.

From ``status.allocation.devices``:

- ``results`` of driver :data:`~kvgpu.dra.slices.DRIVER` in this node's pool (pool name = node
  name): each names a device ``gpu-<index>`` of the node's ResourceSlice and, with consumable
  capacity, what it consumed: ``memory`` (a quantity, whole MiB) and ``cores`` (percent of SMs);
  a result without ``consumedCapacity`` gets the whole card's memory and 100 % on an
  ``exclusive`` card and is refused on a shared one; ``adminAccess`` results are refused (they
  consume nothing, so there would be no limit to enforce);
- ``config`` entries with an opaque config of this driver for the result's request (or for all
  requests) whose ``parameters`` are ``{apiVersion: gpu.kvgpu.io/v1alpha1, kind: SliceConfig,
  priority: 0|1}``: the claim's priority (0 high, 1 low; default 1). A class's config comes
  first, the claim's own overrides it (the order the API lists them in).

One claim string per ResourceClaim: ``v1;claim=<namespace>/<name>;priority=<p>;dev=<UUID>,<MiB>,<cores>``
for each of its devices (``mode=mps`` when its card is an ``mps`` card: then exactly one
device). Every container that references the claim gets the same string and the same region:
they share its quota. Every refusal is a :class:`DraClaimError` naming the claim and what is
wrong.

A result naming a MIG device (``gpu-<index>-mig-<gi>-<ci>``, :mod:`kvgpu.dra.mig`) of a card in a
``dra`` pool is a :class:`PreparedMig`: its container edits (:func:`~kvgpu.dra.mig.mig_container_edits`),
no claim string (the hardware isolates the instance: no shim, no region). A claim is all MIG
devices or all shared-card slices: one mixing both is refused (its containers would run the shim
on the slices and have the MIG instances unlimited beside them, with one ``NVIDIA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgpu.api.values import RequestError, parse_memory_mib
from kvgpu.core import claimstr
from kvgpu.core.inventory import Card, NodeInventory

from .mig import ContainerEdits, MigCapsUnknown, find_mig_device, mig_container_edits
from .slices import CAPACITY_CORES, CAPACITY_MEMORY, DRIVER, device_name

CONFIG_API_VERSION = "gpu.kvgpu.io/v1alpha1"
CONFIG_KIND = "SliceConfig"
DEFAULT_PRIORITY = 1


class DraClaimError(ValueError):
    """A ResourceClaim this node cannot prepare (the message names the claim and the reason)."""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One allocated device of a claim: the kubelet's ``Device`` answer and the card behind it.
    ``memory_mib``/``cores``: the slice (MiB, percent of SMs)."""

    requests: tuple[str, ...]
    pool: str
    device: str
    share_id: str | None
    card: Card
    memory_mib: int
    cores: int


@dataclass(frozen=True, slots=True)
class PreparedMig:
    """One allocated MIG device of a claim: the kubelet's ``Device`` answer, the parent card, the
    instance's UUID and what its container gets (device nodes under ``/dev``, env)."""

    requests: tuple[str, ...]
    pool: str
    device: str
    card: Card
    uuid: str
    edits: ContainerEdits


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    """A claim ready for the node: its shared-card devices and the claim string of the shim, or
    (``mig``) its MIG devices and no claim string (``""``)."""

    namespace: str
    name: str
    uid: str
    devices: tuple[PreparedDevice, ...]
    claim: str
    mig: tuple[PreparedMig, ...] = ()


def _who(claim: Mapping[str, Any]) -> str:
    m = claim.get("metadata") or {}
    return f"ResourceClaim {m.get('namespace', '?')}/{m.get('name', '?')}"


def _priority(config: Any, who: str) -> int:
    """The priority of one opaque SliceConfig's ``parameters``. Raises :class:`DraClaimError`."""
    if not isinstance(config, Mapping):
        raise DraClaimError(f"{who}: opaque config parameters of {DRIVER} must be an object")
    if config.get("apiVersion") != CONFIG_API_VERSION or config.get("kind") != CONFIG_KIND:
        raise DraClaimError(
            f"{who}: opaque config of {DRIVER} must have apiVersion {CONFIG_API_VERSION} and kind "
            f"{CONFIG_KIND}, got {config.get('apiVersion')!r}/{config.get('kind')!r}"
        )
    extra = sorted(set(config) - {"apiVersion", "kind", "priority"})
    if extra:
        raise DraClaimError(f"{who}: unknown keys {extra} in {CONFIG_KIND} (allowed: priority)")
    p = config.get("priority", DEFAULT_PRIORITY)
    if p not in (0, 1) or isinstance(p, bool):
        raise DraClaimError(f"{who}: {CONFIG_KIND} priority must be 0 (high) or 1 (low), got {p!r}")
    return int(p)


def claim_priority(claim: Mapping[str, Any], requests: Sequence[str]) -> int:
    """The priority of ``claim``'s ``requests`` from its allocation's opaque configs of
    :data:`DRIVER` (the last one that applies wins); :data:`DEFAULT_PRIORITY` without one."""
    who = _who(claim)
    alloc = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
    prio = DEFAULT_PRIORITY
    for entry in alloc.get("config") or []:
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != DRIVER:
            continue
        applies = entry.get("requests") or []
        if applies and not set(applies) & set(requests):
            continue
        prio = _priority(opaque.get("parameters"), who)
    return prio


def _amounts(result: Mapping[str, Any], card: Card, who: str) -> tuple[int, int]:
    consumed = result.get("consumedCapacity")
    if result.get("adminAccess"):
        raise DraClaimError(f"{who}: device {result.get('device')}: adminAccess results are not served "
                            "(they consume no capacity, so the shim would have no limit to enforce)")
    if not consumed:
        if card.slicing is not None and card.slicing.mode == "exclusive":
            return card.memory_mib, 100  # an exclusive card, taken whole
        raise DraClaimError(f"{who}: device {result.get('device')} is a shared card but the allocation "
                            "has no consumedCapacity")
    try:
        mem = parse_memory_mib(f"consumedCapacity.{CAPACITY_MEMORY}", consumed.get(CAPACITY_MEMORY))
    except RequestError as e:
        raise DraClaimError(f"{who}: device {result.get('device')}: {e}") from None
    raw = str(consumed.get(CAPACITY_CORES, "0"))
    if not raw.isdigit() or int(raw) > 100:
        raise DraClaimError(f"{who}: device {result.get('device')}: consumedCapacity.{CAPACITY_CORES}="
                            f"{raw!r} is not a whole percent 0..100")
    return mem or card.memory_mib, int(raw)


def node_results(claim: Mapping[str, Any], node: str) -> list[Mapping[str, Any]]:
    """The allocation results of :data:`DRIVER` in ``claim``. Raises :class:`DraClaimError` when
    the claim is not allocated, has none of this driver, or one is in another node's pool."""
    who = _who(claim)
    alloc = (claim.get("status") or {}).get("allocation")
    if not alloc:
        raise DraClaimError(f"{who} is not allocated")
    results = [r for r in ((alloc.get("devices") or {}).get("results") or []) if r.get("driver") == DRIVER]
    if not results:
        raise DraClaimError(f"{who} has no device of driver {DRIVER}")
    foreign = sorted({str(r.get("pool")) for r in results if r.get("pool") != node})
    if foreign:
        raise DraClaimError(f"{who}: devices in pool(s) {foreign} are not on node {node}")
    return results


def _dra_card(card: Card | None, r: Mapping[str, Any], who: str, node: str) -> Card:
    """``card`` when it is a healthy card of a ``dra`` pool; else :class:`DraClaimError`."""
    if card is None or card.slicing is None or card.slicing.allocation != "dra":
        raise DraClaimError(f"{who}: device {r.get('device')!r} is not a {DRIVER} device of node {node}")
    if not card.healthy:
        raise DraClaimError(f"{who}: device {r.get('device')} (card {card.uuid}) is unhealthy: {card.reason}")
    return card


def _mig(r: Mapping[str, Any], node: str, cards: Sequence[Card], who: str) -> PreparedMig | None:
    """The MIG device ``r`` names, or ``None`` when it names none. Raises :class:`DraClaimError`
    (its card not a healthy ``dra`` card in MIG mode, adminAccess, the instance's caps unknown)."""
    found = find_mig_device(NodeInventory(node, tuple(cards)), str(r.get("device")))
    if found is None:
        return None
    card, inst = found
    card = _dra_card(card if card.mig_mode else None, r, who, node)
    if r.get("adminAccess"):
        raise DraClaimError(f"{who}: device {r.get('device')}: adminAccess results are not served")
    try:
        edits = mig_container_edits(card, inst)
    except MigCapsUnknown as e:
        raise DraClaimError(f"{who}: {e}") from None
    return PreparedMig((str(r.get("request", "")),), node, str(r["device"]), card, inst.uuid, edits)


def prepare_claim(claim: Mapping[str, Any], uid: str, node: str, cards: Sequence[Card]) -> PreparedClaim:
    """``claim`` (the API object) as this node prepares it, over the node's ``cards`` (with their
    slicing, MIG instances and health). ``uid``: the UID the kubelet asks for (a claim re-created
    under the same name is refused). Raises :class:`DraClaimError`: UID mismatch, not allocated,
    devices of another node, a device not in the node's slice (unknown, not a ``dra`` card), an
    unhealthy card, bad consumed capacity, a malformed config, an mps card shared with another
    device, a MIG instance whose caps are unknown, MIG devices mixed with shared-card slices."""
    m = claim.get("metadata") or {}
    who = _who(claim)
    if m.get("uid") != uid:
        raise DraClaimError(f"{who} has UID {m.get('uid')!r}, the kubelet asked for {uid!r}")
    by_name = {device_name(c): c for c in cards}
    devices, migs = [], []
    for r in node_results(claim, node):
        if str(r.get("device")) not in by_name and (mig := _mig(r, node, cards, who)) is not None:
            migs.append(mig)
            continue
        card = _dra_card(by_name.get(str(r.get("device"))), r, who, node)
        mem, cores = _amounts(r, card, who)
        devices.append(PreparedDevice((str(r.get("request", "")),), node, str(r["device"]),
                                      r.get("shareID"), card, min(mem, card.memory_mib), cores))
    if migs and devices:
        raise DraClaimError(f"{who}: MIG devices {[x.device for x in migs]} and shared-card slices "
                            f"{[x.device for x in devices]} in one claim: request them in separate claims")
    if migs:
        if len({x.uuid for x in migs}) != len(migs):
            raise DraClaimError(f"{who}: one MIG device allocated twice in one claim")
        return PreparedClaim(str(m.get("namespace")), str(m.get("name")), uid, (), "", tuple(migs))
    uuids = [d.card.uuid for d in devices]
    if len(set(uuids)) != len(uuids):
        raise DraClaimError(f"{who}: one card allocated twice in one claim ({uuids})")
    mps = any(d.card.slicing is not None and d.card.slicing.mode == "mps" for d in devices)
    if mps and len(devices) != 1:
        raise DraClaimError(f"{who}: an mps card's slice must be the claim's only device")
    prio = claim_priority(claim, [r for d in devices for r in d.requests])
    cs = claimstr.ClaimString(
        f"{m.get('namespace')}/{m.get('name')}", prio,
        tuple(claimstr.ClaimDevice(d.card.uuid, d.memory_mib, d.cores) for d in devices),
        "mps" if mps else "hami-core",
    )
    try:
        text = cs.encode()
    except claimstr.ClaimStringError as e:
        raise DraClaimError(f"{who}: {e}") from None
    return PreparedClaim(str(m.get("namespace")), str(m.get("name")), uid, tuple(devices), text)
