"""kvgpu's allocator: which node and which cards a pod's GPU slices go to. Pure, no I/O.

Entry point: :class:`Ledger` (see :mod:`kvgpu.allocator.ledger` for the placement rules,
init containers, the concurrency model and durability; :mod:`kvgpu.allocator.fit` for the
per-card fit rules).
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
