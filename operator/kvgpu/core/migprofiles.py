"""MIG GPU-instance profiles of the cards kvgpu knows, for the simulated inventory and for the
counters DRA publishes for a MIG-mode card.

A card in MIG mode is cut into ``compute_slices`` (7 on Hopper) compute slices and
``memory_slices`` (8) memory slices; each profile takes some of each. Figures of the H200 141GB
(:data:`H200_141GB`):

- the fractions (slices) and instance counts are NVIDIA's *MIG User Guide*, "Supported MIG
  Profiles", table "GPU Instance Profiles on H200";
- SMs and memory are what ``nvidia-smi mig -lgip`` prints on an H200 for ``1g.18gb`` (16 SMs,
  16.00 GiB), ``2g.35gb`` (32 SMs, 32.50 GiB) and ``7g.141gb`` (132 SMs, 140.00 GiB); the SMs of
  ``1g.35gb`` (26), ``3g.71gb`` (60) and ``4g.71gb`` (64) are those of the same profiles on the H100
  (the same GH100 die with 132 SMs); the memory of ``1g.35gb`` is that of ``2g.35gb`` (both take 2/8),
  the memory of the 4/8 profiles is interpolated (65.75 GiB) — the NVML path reads the real figures
  from the card, these only feed simulations.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU-instance profile: ``name`` like ``1g.18gb``; ``memory_mib`` (MiB) and
    ``sm_count`` of one instance; the card's compute/memory slices it takes; ``max_count`` how
    many fit on one card."""

    name: str
    compute_slices: int
    memory_slices: int
    sm_count: int
    memory_mib: int
    max_count: int


@dataclass(frozen=True, slots=True)
class MigCardModel:
    """A card model's MIG geometry: slices of the whole card and its profiles by name."""

    model: str
    compute_slices: int
    memory_slices: int
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile:
        """The profile ``name``. Raises ``ValueError`` naming the allowed profiles."""
        for p in self.profiles:
            if p.name == name:
                return p
        allowed = ", ".join(p.name for p in self.profiles)
        raise ValueError(f"MIG profile {name!r} is not one of the {self.model}'s: {allowed}")


H200_141GB = MigCardModel(
    model="NVIDIA H200",
    compute_slices=7,
    memory_slices=8,
    profiles=(
        MigProfile("1g.18gb", 1, 1, 16, 16384, 7),
        MigProfile("1g.35gb", 1, 2, 26, 33280, 4),
        MigProfile("2g.35gb", 2, 2, 32, 33280, 3),
        MigProfile("3g.71gb", 3, 4, 60, 67328, 2),
        MigProfile("4g.71gb", 4, 4, 64, 67328, 1),
        MigProfile("7g.141gb", 7, 8, 132, 143360, 1),
    ),
)

MIG_CARD_MODELS: tuple[MigCardModel, ...] = (H200_141GB,)


def mig_card_model(model: str) -> MigCardModel:
    """The MIG geometry of card ``model`` (matched by substring, e.g. ``NVIDIA H200``).
    Raises ``ValueError`` naming the models that have a profile table."""
    for m in MIG_CARD_MODELS:
        if m.model in model or model in m.model:
            return m
    known = ", ".join(m.model for m in MIG_CARD_MODELS)
    raise ValueError(f"no MIG profile table for card model {model!r} (known: {known})")


def profile_from_name(device_name: str) -> str:
    """The profile in an NVML MIG device name: ``NVIDIA H200 MIG 1g.18gb`` → ``1g.18gb``
    (``+me`` kept: ``1g.18gb+me``). ``""`` when the name carries none."""
    parts = device_name.split()
    for i, p in enumerate(parts[:-1]):
        if p == "MIG":
            return parts[i + 1]
    return ""
