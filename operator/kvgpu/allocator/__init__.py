"""kvgpu's allocator: which node and which cards a pod's GPU slices go to. Pure, no I/O.

Entry point: :class:`Ledger` (see :mod:`kvgpu.allocator.ledger` for the placement rules,
init containers, the concurrency model and durability; :mod:`kvgpu.allocator.fit` for the
per-card fit rules). The ledger's parts: :mod:`~kvgpu.allocator.usage` (what it reports),
:mod:`~kvgpu.allocator.node` (a node's cards and aggregates), :mod:`~kvgpu.allocator.placement`
(placement and the reasons a node does not fit); GPU preemption's victim choice in
:mod:`~kvgpu.allocator.preempt`, namespace quotas in :mod:`~kvgpu.allocator.quota`.
"""

from kvgpu.allocator.ledger import (
    AllocationError,
    CardUsage,
    Ledger,
    LedgerSnapshot,
    NodeUsage,
    PoolUsage,
    explain,
    footprint,
)

__all__ = [
    "AllocationError",
    "CardUsage",
    "Ledger",
    "LedgerSnapshot",
    "NodeUsage",
    "PoolUsage",
    "explain",
    "footprint",
]
