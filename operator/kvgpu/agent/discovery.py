"""Card discovery: NVML (``import pynvml`` from nvidia-ml-py) or a simulated inventory.

Both backends return a :class:`~kvgpu.core.inventory.NodeInventory`; everything after discovery
(registration, health, device plugin, exporter) is one code path.

This module imports only the standard library, ``kvgpu.core`` (pure data) and, lazily, ``pynvml``
(and ``yaml`` for YAML simulated configs), so ``bench/gpu/discovery_check.py`` can run it on a GPU
machine that has nothing but nvidia-ml-py installed.

SM count: NVML reports it through ``nvmlDeviceGetAttributes`` (``multiprocessorCount``); some
drivers answer ``NOT_SUPPORTED`` for full (non-MIG) cards, so the CUDA driver attribute
``CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`` (read through ``libcuda.so.1`` with ctypes, matched by
UUID, never by ordinal) is the fallback, then a table of known models. ``sm_source`` in
:class:`NvmlCardDetail` says which one answered.

MIG: a card whose current MIG mode is on is listed with its MIG devices as they exist
(``nvmlDeviceGetMaxMigDeviceCount`` slots, ``nvmlDeviceGetMigDeviceHandleByIndex``; an empty slot
is skipped): UUID, memory, SMs (``multiprocessorCount``), GPU/compute-instance ids, the profile
from the device name (``NVIDIA H200 MIG 1g.18gb``), and the minors of their
``/dev/nvidia-caps`` nodes from the driver's ``/proc/driver/nvidia-caps/mig-minors``. Discovery only
reads: it never changes a card's MIG mode or instances.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvgpu.core.inventory import Card, MigInstance, NodeInventory, SimulatedNode, parse_simulated
from kvgpu.core.migprofiles import profile_from_name

MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"

log = logging.getLogger(__name__)


class DiscoveryError(RuntimeError):
    """Discovery could not produce an inventory (NVML missing/failing, bad simulated config)."""


class Discovery(Protocol):
    """A discovery backend. ``discover()`` returns the node's cards (health all true, no slicing)."""

    def discover(self) -> NodeInventory: ...


# --------------------------------------------------------------------------- simulated backend


def load_simulated_config(path: str | os.PathLike[str]) -> list[SimulatedNode]:
    """Read the simulated backend's config file (YAML if PyYAML is importable, else JSON).

    Returns the parsed nodes. Raises :class:`DiscoveryError` if the file is missing or malformed.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise DiscoveryError(f"simulated inventory {p}: {e.strerror or e}") from e
    doc: Any
    try:
        if p.suffix == ".json":
            doc = json.loads(text)
        else:
            try:
                import yaml
            except ImportError:  # JSON is valid YAML's subset we can always read
                doc = json.loads(text)
            else:
                doc = yaml.safe_load(text)
        if not isinstance(doc, dict):
            raise ValueError("top level must be a mapping with 'nodes'")
        return parse_simulated(doc)
    except ValueError as e:  # json.JSONDecodeError and yaml errors are ValueError / YAMLError
        raise DiscoveryError(f"simulated inventory {p}: {e}") from e
    except Exception as e:  # yaml.YAMLError is not a ValueError
        raise DiscoveryError(f"simulated inventory {p}: {e}") from e


@dataclass
class SimulatedDiscovery:
    """Discovery from the simulated config: the entry whose ``name`` is ``node``.

    The file is re-read on every ``discover()`` so a demo can add or remove cards live.
    Raises :class:`DiscoveryError` when the file has no entry for ``node``.
    """

    node: str
    path: str

    def node_spec(self) -> SimulatedNode:
        for n in load_simulated_config(self.path):
            if n.name == self.node:
                return n
        raise DiscoveryError(f"simulated inventory {self.path} has no node named {self.node!r}")

    def discover(self) -> NodeInventory:
        return self.node_spec().inventory()


# --------------------------------------------------------------------------- NVML backend

# SMs of full cards by model substring (fallback only; NVML or CUDA normally answer).
KNOWN_SM_COUNTS: tuple[tuple[str, int], ...] = (
    ("H200", 132),
    ("H100 PCIe", 114),
    ("H100 NVL", 132),
    ("H100", 132),
    ("H800", 132),
    ("GH200", 132),
    ("B200", 148),
    ("A100", 108),
    ("A800", 108),
    ("A30", 56),
    ("A10G", 80),
    ("A10", 72),
    ("L40S", 142),
    ("L40", 142),
    ("L4", 58),
    ("T4", 40),
    ("V100", 80),
)

_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16


@dataclass(frozen=True)
class NvmlCardDetail:
    """What discovery learnt about one card beyond :class:`Card` (for the GPU check and logs)."""

    uuid: str
    index: int
    memory_total_bytes: int
    sm_source: str  # "nvml" | "cuda" | "table" | "unknown"
    pci_bus_id: str


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def cuda_sm_counts(lib: str = "libcuda.so.1") -> dict[str, int]:
    """SM count per card UUID (``GPU-...``) from the CUDA driver API; ``{}`` if unavailable.

    Never raises: a machine without the driver, or a failing ``cuInit``, gives ``{}``.
    Creates no CUDA context.
    """
    try:
        cu = ctypes.CDLL(lib)
    except OSError:
        return {}
    out: dict[str, int] = {}
    try:
        if cu.cuInit(0) != 0:
            return {}
        n = ctypes.c_int()
        if cu.cuDeviceGetCount(ctypes.byref(n)) != 0:
            return {}
        get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
        for ordinal in range(n.value):
            dev = ctypes.c_int()
            if cu.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
                continue
            raw = (ctypes.c_ubyte * 16)()
            if get_uuid(raw, dev) != 0:
                continue
            h = bytes(raw).hex()
            uuid = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
            sms = ctypes.c_int()
            if (
                cu.cuDeviceGetAttribute(ctypes.byref(sms), _CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
                == 0
            ):
                out[uuid] = sms.value
    except (AttributeError, OSError):
        return out
    return out


def _table_sm_count(model: str) -> int:
    for key, sms in KNOWN_SM_COUNTS:
        if key in model:
            return sms
    return 0


def _numa_from_sysfs(bus_id: str, sysfs: str = "/sys/bus/pci/devices") -> int | None:
    # NVML prints "00000000:19:00.0"; sysfs uses a 4-digit domain, lower case.
    bus = bus_id.lower()
    if len(bus.split(":")[0]) == 8:
        bus = bus[4:]
    try:
        v = int(Path(sysfs, bus, "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return v if v >= 0 else None


def read_mig_minors(path: str = MIG_MINORS) -> dict[str, int]:
    """The driver's MIG capability table, ``{"gpu0/gi7/access": 66, "gpu0/gi7/ci0/access": 67, ...}``
    (``{}`` when the file is missing or unreadable: the caps are then unknown)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, minor = line.strip().rpartition(" ")
        if name and minor.isdigit():
            out[name] = int(minor)
    return out


def _mig_instances(nv: Any, parent: Any, gpu_minor: int, minors: dict[str, int]) -> tuple[MigInstance, ...]:
    """The MIG devices of ``parent`` (a card in MIG mode). Never raises: a card whose MIG devices
    cannot be counted, and a MIG device that cannot be read, are logged and offer nothing."""
    try:
        slots = int(nv.nvmlDeviceGetMaxMigDeviceCount(parent))
    except Exception as e:
        log.warning("NVML cannot count the MIG devices of MIG-mode card %s: %s", gpu_minor, e)
        return ()
    out: list[MigInstance] = []
    for i in range(slots):
        try:
            mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, i)
        except Exception:  # NOT_FOUND: no MIG device in this slot
            continue
        try:
            uuid = _text(nv.nvmlDeviceGetUUID(mh))
            mem = int(nv.nvmlDeviceGetMemoryInfo(mh).total) // (1 << 20)
            sms = int(nv.nvmlDeviceGetAttributes(mh).multiprocessorCount)
            gi = int(nv.nvmlDeviceGetGpuInstanceId(mh))
            ci = int(nv.nvmlDeviceGetComputeInstanceId(mh))
            profile = profile_from_name(_text(nv.nvmlDeviceGetName(mh)))
        except Exception as e:
            log.warning("NVML query of MIG device %d of card %s failed (not offered): %s", i, gpu_minor, e)
            continue
        out.append(MigInstance(uuid, i, profile, mem, sms, gi, ci,
                               minors.get(f"gpu{gpu_minor}/gi{gi}/access"),
                               minors.get(f"gpu{gpu_minor}/gi{gi}/ci{ci}/access")))
    return tuple(out)


@dataclass
class NvmlDiscovery:
    """Discovery through NVML.

    ``nvml`` is the ``pynvml`` module (injectable for tests); ``cuda_sm`` returns SM counts per
    UUID when NVML cannot (default :func:`cuda_sm_counts`, called at most once per process).
    ``discover()`` raises :class:`DiscoveryError` if NVML cannot be loaded or initialised;
    per-card optional queries (NUMA, MIG, SMs) that fail degrade to ``None``/``False``/``0``.
    ``mig_minors``: the driver's MIG capability table (read once per ``discover()`` when a card is
    in MIG mode).
    """

    node: str
    nvml: Any = None
    cuda_sm: Callable[[], dict[str, int]] = cuda_sm_counts
    sysfs: str = "/sys/bus/pci/devices"
    mig_minors: str = MIG_MINORS

    def __post_init__(self) -> None:
        self._initialised = False
        self._cuda_cache: dict[str, int] | None = None
        self.details: list[NvmlCardDetail] = []

    def _lib(self) -> Any:
        if self.nvml is None:
            try:
                import pynvml
            except ImportError as e:
                raise DiscoveryError("nvidia-ml-py (pynvml) is not installed") from e
            self.nvml = pynvml
        if not self._initialised:
            try:
                self.nvml.nvmlInit()
            except Exception as e:
                raise DiscoveryError(f"NVML init failed: {e}") from e
            self._initialised = True
        return self.nvml

    def shutdown(self) -> None:
        """Release NVML (safe to call twice)."""
        if self._initialised:
            try:
                self.nvml.nvmlShutdown()
            finally:
                self._initialised = False

    def _sm_count(self, nv: Any, handle: Any, uuid: str, model: str) -> tuple[int, str]:
        try:
            sms = int(nv.nvmlDeviceGetAttributes(handle).multiprocessorCount)
            if sms > 0:
                return sms, "nvml"
        except Exception:
            pass
        if self._cuda_cache is None:
            self._cuda_cache = self.cuda_sm()
        if self._cuda_cache.get(uuid, 0) > 0:
            return self._cuda_cache[uuid], "cuda"
        sms = _table_sm_count(model)
        return sms, ("table" if sms else "unknown")

    def discover(self) -> NodeInventory:
        nv = self._lib()
        try:
            driver = _text(nv.nvmlSystemGetDriverVersion())
            cv = int(nv.nvmlSystemGetCudaDriverVersion())
            cuda = f"{cv // 1000}.{(cv % 1000) // 10}"
            count = int(nv.nvmlDeviceGetCount())
        except Exception as e:
            raise DiscoveryError(f"NVML query failed: {e}") from e
        cards: list[Card] = []
        details: list[NvmlCardDetail] = []
        minors: dict[str, int] | None = None
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(nv.nvmlDeviceGetUUID(h))
                model = _text(nv.nvmlDeviceGetName(h))
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                total = int(mem.total)
            except Exception as e:
                raise DiscoveryError(f"NVML query of card {i} failed: {e}") from e
            try:
                index = int(nv.nvmlDeviceGetIndex(h))
            except Exception:
                index = i
            try:
                bus_id = _text(nv.nvmlDeviceGetPciInfo(h).busId)
            except Exception:
                bus_id = ""
            numa: int | None
            try:
                numa = int(nv.nvmlDeviceGetNumaNodeId(h))
                numa = numa if numa >= 0 else None
            except Exception:
                numa = _numa_from_sysfs(bus_id, self.sysfs) if bus_id else None
            try:
                mig = bool(nv.nvmlDeviceGetMigMode(h)[0])
            except Exception:  # NOT_SUPPORTED on cards without MIG
                mig = False
            try:
                minor: int | None = int(nv.nvmlDeviceGetMinorNumber(h))
            except Exception:  # NOT_SUPPORTED on some platforms: the device plugin uses the index
                minor = None
            sms, sm_source = self._sm_count(nv, h, uuid, model)
            instances: tuple[MigInstance, ...] = ()
            if mig:
                if minors is None:
                    minors = read_mig_minors(self.mig_minors)
                instances = _mig_instances(nv, h, index if minor is None else minor, minors)
            cards.append(Card(uuid, index, model, total // (1 << 20), sms, numa, mig, minor=minor,
                              mig_instances=instances))
            details.append(NvmlCardDetail(uuid, index, total, sm_source, bus_id))
        self.details = details
        cards.sort(key=lambda c: c.index)
        return NodeInventory(self.node, tuple(cards), "nvml", driver, cuda)


def make_discovery(node: str, simulated: str | None = None) -> Discovery:
    """The backend for ``node``: simulated when a config path is given, else NVML."""
    if simulated:
        return SimulatedDiscovery(node, simulated)
    return NvmlDiscovery(node)
