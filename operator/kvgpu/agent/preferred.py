"""``GetPreferredAllocation``'s fallback policy when the container being admitted is not identified.

Pure; imported by :mod:`kvgpu.agent.deviceplugin` (which re-exports :func:`preferred`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

ID_SEP = "::"


def card_of(device_id: str) -> str:
    """The card UUID of a replica ID (IDs without the separator are taken as a UUID)."""
    return device_id.split(ID_SEP, 1)[0]


# A hint provider maps a request size to the card-UUID lists of pending claims on this node.
HintProvider = Callable[[int], Sequence[Sequence[str]]]


def preferred(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    healthy: set[str],
    hint: Sequence[Sequence[str]] = (),
) -> list[str]:
    """Pick ``size`` replica IDs: all of ``must_include``, then one replica per distinct card.

    Cards come from ``hint`` first when exactly one hinted card list has ``size`` cards that are
    all available; then healthy cards with the most free replicas (least used) first; replicas
    of an already-picked card only when no other card is left. Returns fewer than ``size`` IDs
    only if fewer are available.
    """
    picked: list[str] = list(dict.fromkeys(must_include))[:size]
    free: dict[str, list[str]] = {}
    for d in available:
        if d not in picked:
            free.setdefault(card_of(d), []).append(d)
    used_cards = Counter(card_of(d) for d in picked)
    candidates = [list(h) for h in hint if len(h) == size and all(u in free or u in used_cards for u in h)]
    order: list[str] = []
    if len(candidates) == 1:
        order = [u for u in candidates[0] if u in free]
    order += sorted(
        (u for u in free if u not in order),
        key=lambda u: (u not in healthy, -len(free[u]), u),
    )
    # First pass: one replica per card not yet used; then fill from any card.
    for u in order:
        if len(picked) >= size:
            break
        if used_cards[u] == 0 and free[u]:
            picked.append(free[u].pop(0))
            used_cards[u] += 1
    for u in order:
        while len(picked) < size and free[u]:
            picked.append(free[u].pop(0))
    return picked
