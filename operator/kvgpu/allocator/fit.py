"""Per-card fit rules and the card state the ledger keeps. Pure, no I/O.

Units everywhere: memory in MiB of the card's *virtual* memory (physical MiB x the pool's
``memoryScaling``, rounded down), cores in percent of the card's SMs (a card has
``100 x coreScaling`` of them, rounded), slots = the pool's ``splitCount``.

The rules, in the order they are checked for one container on one card:

1. the card is usable: healthy, covered by a pool (has ``slicing``) whose ``allocation`` is
   ``extender`` (a ``dra`` pool's cards are kube-scheduler's: docs/dra.md), not in MIG mode, and its
   pool mode is ``hami-core``, ``mps`` or ``exclusive`` (other modes are not implemented yet);
   an ``mps`` card takes only one-card requests (a container is the client of one card's MPS
   server: the agent runs one per card);
2. ``types`` (any listed substring in the model, case-insensitive) and ``exclude_types``
   (none of them); ``uuids`` (listed exactly) and ``exclude_uuids`` (not listed);
3. the card holds no more than its pool allows now (a pool whose ``splitCount``,
   ``memoryScaling`` or ``coreScaling`` was lowered under live slices: the pool is
   ``Overcommitted`` and the card takes nothing new until enough of them end);
   a free slot (an ``exclusive``-mode card has exactly one slot);
4. nobody holds the card exclusively;
5. an exclusive request — ``cores`` 100, or any request on an ``exclusive``-mode card — needs
   a card with no slice at all;
6. memory: ``memory_mib`` if > 0, else ``memory_percent`` % of the card's virtual memory
   (rounded down, at least 1 MiB), else the whole card; an ``exclusive``-mode card always grants
   its whole memory. Must be ≤ the card's free memory;
7. cores ≤ the card's free cores (an ``exclusive``-mode card grants 100);
8. a request with ``cores`` 0 (no compute limit) does not join a card whose cores are all taken.

An ``mps`` card is accounted like a ``hami-core`` one: its cores become the client's MPS active
thread percentage (0 = 100), and ``cores`` 100 holds it exclusively.

A grant with ``cores`` 100 is exclusive on its card whatever the card's ``coreScaling`` is
(this matches the ``KVGPU_CLAIM`` contract, where 100 means "exclusive card"; HAMi instead
stops treating 100 as exclusive once ``coreScaling`` > 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgpu.core.inventory import Card
from kvgpu.core.requests import ContainerRequest, Policy

SUPPORTED_MODES = ("hami-core", "exclusive", "mps")

# Reason codes of a card that does not fit (index into _PHRASES).
UNHEALTHY, NO_POOL, MIG, BAD_MODE = 0, 1, 2, 3
TYPE_NOT_LISTED, TYPE_EXCLUDED, UUID_NOT_LISTED, UUID_EXCLUDED = 4, 5, 6, 7
NO_SLOT, HELD_EXCLUSIVE, NOT_IDLE, NO_MEMORY, NO_CORES, COMPUTE_FULL = 8, 9, 10, 11, 12, 13
NUMA_SPLIT, NO_CAPACITY, MPS_ONE_CARD, OVERCOMMITTED, DRA = 14, 15, 16, 17, 18

PHRASES = (
    "unhealthy",
    "not covered by a VGPUPool",
    "in MIG mode",
    "in a pool mode not supported yet",
    "not of a requested type",
    "of an excluded type",
    "not a requested UUID",
    "an excluded UUID",
    "without a free slot",
    "held exclusively",
    "not idle (needed by an exclusive request)",
    "with too little free memory",
    "with too few free cores",
    "with all cores taken (needed by a request without a core limit)",
    "on another NUMA node",
    "given no slots or no memory by its pool",
    "in mps mode (one card per container)",
    "over its VGPUPool's current shape",
    "in a DRA pool (allocated by kube-scheduler through ResourceClaims)",
)


class CardState:
    """One card's capacity (fixed for an inventory) and usage (changed by reservations)."""

    __slots__ = (
        "cores",
        "cores_total",
        "excl",
        "excl_mode",
        "index",
        "mem",
        "mem_total",
        "mode",
        "model",
        "model_l",
        "numa",
        "pods",
        "pool",
        "slots",
        "slots_total",
        "unusable",
        "uuid",
    )

    def __init__(self, card: Card) -> None:
        self.uuid = card.uuid
        self.index = card.index
        self.model = card.model
        self.model_l = card.model.lower()
        self.numa = card.numa
        sl = card.slicing
        self.pool = sl.pool if sl else ""
        self.mode = sl.mode if sl else ""
        self.unusable: int | None = None
        if not card.healthy:
            self.unusable = UNHEALTHY
        elif sl is None:
            self.unusable = NO_POOL
        elif sl.allocation == "dra":
            self.unusable = DRA
        elif card.mig_mode:
            self.unusable = MIG
        elif sl.mode not in SUPPORTED_MODES:
            self.unusable = BAD_MODE
        self.excl_mode = bool(sl and sl.mode == "exclusive")
        if sl is None:
            self.slots_total = self.mem_total = self.cores_total = 0
        else:
            self.slots_total = 1 if self.excl_mode else max(0, sl.split_count)
            self.mem_total = max(0, int(card.memory_mib * sl.memory_scaling))
            self.cores_total = max(0, round(100 * sl.core_scaling))
        if self.unusable is None and (self.slots_total == 0 or self.mem_total == 0):
            self.unusable = NO_CAPACITY
        # Usage: slices, MiB, cores, pods holding it exclusively, pods with any slice on it.
        self.slots = self.mem = self.cores = self.excl = self.pods = 0

    def usage(self) -> tuple[int, int, int, int, int]:
        return (self.slots, self.mem, self.cores, self.excl, self.pods)

    def over(self) -> bool:
        """Holds more than its pool's shape allows now (a pool shrunk under live slices)."""
        return self.slots > self.slots_total or self.mem > self.mem_total or self.cores > self.cores_total


@dataclass(frozen=True, slots=True)
class Need:
    """A container request, normalised once per decision (see :func:`need`)."""

    req: ContainerRequest
    cards: int
    mem_abs: int  # > 0: absolute MiB
    pct: int  # > 0: percent of the card's virtual memory (when mem_abs is 0)
    whole: bool  # neither: the whole card
    cores: int
    exclusive: bool  # cores == 100
    types: tuple[str, ...]
    exclude_types: tuple[str, ...]
    uuids: frozenset[str]
    exclude_uuids: frozenset[str]

    def describe(self) -> str:
        """E.g. ``2 cards with 3000 MiB and 30 % cores each``."""
        if self.mem_abs:
            mem = f"{self.mem_abs} MiB"
        elif self.pct:
            mem = f"{self.pct} % of memory"
        else:
            mem = "the whole memory"
        cores = f" and {self.cores} % cores" if self.cores else ""
        cards = "1 card" if self.cards == 1 else f"{self.cards} cards"
        return f"{cards} with {mem}{cores}{' each' if self.cards > 1 else ''}"


def need(req: ContainerRequest) -> Need:
    """Validate and normalise a :class:`ContainerRequest`. Raises ``ValueError``."""
    if req.cards < 1:
        raise ValueError(f"container {req.container!r}: cards must be >= 1, got {req.cards}")
    if req.memory_mib < 0:
        raise ValueError(f"container {req.container!r}: memory_mib must be >= 0")
    if req.memory_percent is not None and not 1 <= req.memory_percent <= 100:
        raise ValueError(f"container {req.container!r}: memory_percent must be 1..100")
    if not 0 <= req.cores <= 100:
        raise ValueError(f"container {req.container!r}: cores must be 0..100, got {req.cores}")
    pct = 0 if req.memory_mib or req.memory_percent is None else req.memory_percent
    return Need(
        req=req,
        cards=req.cards,
        mem_abs=req.memory_mib,
        pct=pct,
        whole=not req.memory_mib and not pct,
        cores=req.cores,
        exclusive=req.cores >= 100,
        types=tuple(t.lower() for t in req.types if t),
        exclude_types=tuple(t.lower() for t in req.exclude_types if t),
        uuids=frozenset(req.uuids),
        exclude_uuids=frozenset(req.exclude_uuids),
    )


def selectable(c: CardState, n: Need) -> int | None:
    """Rules 1-2 (independent of usage): None, or the reason code."""
    if c.unusable is not None:
        return c.unusable
    if n.cards > 1 and c.mode == "mps":
        return MPS_ONE_CARD
    if n.types and not any(t in c.model_l for t in n.types):
        return TYPE_NOT_LISTED
    if n.exclude_types and any(t in c.model_l for t in n.exclude_types):
        return TYPE_EXCLUDED
    if n.uuids and c.uuid not in n.uuids:
        return UUID_NOT_LISTED
    if c.uuid in n.exclude_uuids:
        return UUID_EXCLUDED
    return None


def fit(c: CardState, n: Need, extra: list[int] | None) -> tuple[int, int] | int:
    """Rules 3-8 on ``c`` with ``extra`` = [slots, MiB, cores, excl, pods] already taken by the
    pod being placed. Returns ``(memory MiB, cores)`` to grant, or a reason code (int)."""
    if c.slots > c.slots_total or c.mem > c.mem_total or c.cores > c.cores_total:
        return OVERCOMMITTED
    slots, mem, cores, excl, pods = c.slots, c.mem, c.cores, c.excl, c.pods
    if extra is not None:
        slots += extra[0]
        mem += extra[1]
        cores += extra[2]
        excl += extra[3]
        pods += extra[4]
    if slots >= c.slots_total:
        return NO_SLOT
    if excl:
        return HELD_EXCLUSIVE
    if c.excl_mode:
        if pods:
            return NOT_IDLE
        want_mem, want_cores = c.mem_total, 100
        if n.mem_abs > c.mem_total:
            return NO_MEMORY
    else:
        if n.exclusive and pods:
            return NOT_IDLE
        if n.mem_abs:
            want_mem = n.mem_abs
        elif n.pct:
            want_mem = max(1, c.mem_total * n.pct // 100)
        else:
            want_mem = c.mem_total
        want_cores = n.cores
    if want_mem > c.mem_total - mem:
        return NO_MEMORY
    if want_cores > c.cores_total - cores:
        return NO_CORES
    if want_cores == 0 and c.cores_total and cores >= c.cores_total:
        return COMPUTE_FULL
    return (want_mem, want_cores)


def card_score(c: CardState, extra: list[int] | None, mem: int, cores: int) -> float:
    """How full the card would be with this slice: mean of slots, memory and cores fractions,
    0.0 (empty) .. 1.0 (full). Used to order cards by the GPU policy."""
    slots, used_mem, used_cores = c.slots + 1, c.mem + mem, c.cores + cores
    if extra is not None:
        slots += extra[0]
        used_mem += extra[1]
        used_cores += extra[2]
    s = slots / c.slots_total + used_mem / c.mem_total
    if c.cores_total:
        return (s + used_cores / c.cores_total) / 3
    return s / 2


def order_key(policy: Policy, score: float, c: CardState) -> tuple[float, int]:
    """Sort key: ``binpack`` puts the fullest card first, ``spread`` the emptiest; index breaks
    ties so the answer is deterministic."""
    return (-score if policy == Policy.BINPACK else score, c.index)
