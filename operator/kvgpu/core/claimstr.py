"""The ``KVGPU_CLAIM`` string: the shim's input, written by the operator at bind time.

Format, version 1 (ASCII, ``;``-separated fields, order free except ``v1`` first)::

    v1;claim=<namespace>/<name>;priority=<0|1>;dev=<UUID>,<memory MiB>,<cores percent>[;dev=...][;mode=mps]

- ``memory MiB`` is an integer >= 1 (the card's slice of memory);
- ``cores percent`` is an integer 0..100 (0 = no compute limit, 100 = exclusive card);
- at least one ``dev``; UUIDs are NVML's ``GPU-xxxxxxxx-...`` strings, unique within the claim;
- ``mode`` (optional, at most once): ``mps`` = the container is an MPS client of its card's
  server: the driver partitions the SMs (``cores`` is the client's active thread percentage),
  so the shim keeps its compute gate off, and it sets the MPS client env from this claim
  (pipe directory, thread percentage, pinned memory limit) before CUDA starts; ``hami-core``
  (the default) = the shim's own compute gate. Written only for ``mps``, so claims of other
  modes read by older shims are unchanged.

The shim's C parser (shim/vgpu_config.c) implements the same grammar; the property tests
round-trip both. A string that does not parse makes the shim refuse to initialise CUDA.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]{1,80}$")
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


#: Values of the ``mode`` field.
MODES = ("hami-core", "mps")


class ClaimStringError(ValueError):
    """A ``KVGPU_CLAIM`` string that does not follow the v1 grammar."""


@dataclass(frozen=True, slots=True)
class ClaimDevice:
    uuid: str
    memory_mib: int
    cores: int


@dataclass(frozen=True, slots=True)
class ClaimString:
    claim: str  # "<namespace>/<name>" of the VGPUClaim
    priority: int
    devices: tuple[ClaimDevice, ...]
    mode: str = "hami-core"  # or "mps"

    def encode(self) -> str:
        parts = ["v1", f"claim={self.claim}", f"priority={self.priority}"]
        parts += [f"dev={d.uuid},{d.memory_mib},{d.cores}" for d in self.devices]
        if self.mode != "hami-core":
            parts.append(f"mode={self.mode}")
        out = ";".join(parts)
        decode(out)  # never emit what the shim would refuse
        return out


def decode(text: str) -> ClaimString:
    """Parse a v1 claim string. Raises :class:`ClaimStringError` naming the bad field."""
    fields = text.strip().split(";")
    if not fields or fields[0] != "v1":
        raise ClaimStringError(f"claim string must start with 'v1;', got {text[:20]!r}")
    claim, priority, devices, mode = "", 1, [], ""
    seen: set[str] = set()
    for f in fields[1:]:
        key, sep, value = f.partition("=")
        if not sep:
            raise ClaimStringError(f"field {f!r} is not key=value")
        if key == "claim":
            if not _CLAIM.match(value):
                raise ClaimStringError(f"claim={value!r} is not <namespace>/<name>")
            claim = value
        elif key == "priority":
            if value not in ("0", "1"):
                raise ClaimStringError(f"priority={value!r} must be 0 or 1")
            priority = int(value)
        elif key == "dev":
            bits = value.split(",")
            if len(bits) != 3 or not _UUID.match(bits[0]):
                raise ClaimStringError(f"dev={value!r} must be <UUID>,<memory MiB>,<cores>")
            if not (bits[1].isdigit() and bits[2].isdigit()):
                raise ClaimStringError(f"dev={value!r}: memory and cores must be non-negative integers")
            mem, cores = int(bits[1]), int(bits[2])
            if mem < 1 or mem > 1 << 30 or cores > 100:
                raise ClaimStringError(f"dev={value!r}: memory 1..2^30 MiB, cores 0..100")
            if bits[0] in seen:
                raise ClaimStringError(f"dev {bits[0]} appears twice")
            seen.add(bits[0])
            devices.append(ClaimDevice(bits[0], mem, cores))
        elif key == "mode":
            if mode:
                raise ClaimStringError("mode appears twice")
            if value not in MODES:
                raise ClaimStringError(f"mode={value!r} must be one of {', '.join(MODES)}")
            mode = value
        else:
            raise ClaimStringError(f"unknown field {key!r}")
    if not devices:
        raise ClaimStringError("claim string names no dev=")
    if not claim:
        raise ClaimStringError("claim string has no claim=<namespace>/<name>")
    return ClaimString(claim, priority, tuple(devices), mode or "hami-core")
