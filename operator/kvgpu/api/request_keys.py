"""The key catalogue of pod requests: kvgpu's request annotations and HAMi's keys, the allowed
forms the errors quote, their documentation (:data:`ANNOTATION_KEYS`, :data:`HAMI_KEYS`,
:data:`DOC_MARKDOWN`, read by :mod:`kvgpu.api.crdgen`), and the key names people mistype
(:func:`suggest_key`, :func:`unknown_annotations`). Pure, no I/O."""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgpu.api.models import (
    DEFAULT_MIN_SLICE_MIB,
    MAX_CARD_MEMORY_MIB,
    MAX_CARDS,
)
from kvgpu.core import keys

# --------------------------------------------------------------------------- keys

K = keys.GROUP + "/"
GPU = K + "gpu"
GPUMEM = K + "gpumem"
GPUMEM_PERCENTAGE = K + "gpumem-percentage"
GPUCORES = K + "gpucores"
PRIORITY = K + "priority"
CONTAINERS = K + "containers"
GPU_TYPE = K + "gpu-type"
EXCLUDE_GPU_TYPE = K + "exclude-gpu-type"
GPU_UUID = K + "gpu-uuid"
EXCLUDE_GPU_UUID = K + "exclude-gpu-uuid"
NUMA_BIND = K + "numa-bind"
NODE_POLICY = K + "node-policy"
GPU_POLICY = K + "gpu-policy"

HAMI_GPU = "nvidia.com/gpu"
HAMI_GPUMEM = "nvidia.com/gpumem"
HAMI_GPUMEM_PERCENTAGE = "nvidia.com/gpumem-percentage"
HAMI_GPUCORES = "nvidia.com/gpucores"
HAMI_PRIORITY = "nvidia.com/priority"
HAMI_USE_TYPE = "nvidia.com/use-gputype"
HAMI_NOUSE_TYPE = "nvidia.com/nouse-gputype"
HAMI_USE_UUID = "nvidia.com/use-gpuuuid"
HAMI_NOUSE_UUID = "nvidia.com/nouse-gpuuuid"
HAMI_NUMA_BIND = "nvidia.com/numa-bind"
HAMI_NODE_POLICY = "hami.io/node-scheduler-policy"
HAMI_GPU_POLICY = "hami.io/gpu-scheduler-policy"
HAMI_VGPU_MODE = "nvidia.com/vgpu-mode"
HAMI_SCORING_WEIGHTS = "hami.io/device-scoring-weights"

# Allowed forms, used in messages and in docs/api.md.
FORM_CARDS = f"use a whole number of cards from 1 to {MAX_CARDS}"
FORM_MEMORY = "use MiB like 3000 or a quantity like 3Gi"
FORM_PERCENT = "use a whole number from 1 to 100 (percent of the card's memory)"
FORM_HAMI_PERCENT = "use a whole number from 0 to 100 (percent of the card's memory; 0 = unset)"
FORM_CORES = "use a whole number from 0 to 100 (percent of the card's SMs; 100 = an exclusive card)"
FORM_PRIORITY = "use 0 (high) or 1 (low)"
FORM_POLICY = "use binpack or spread"
FORM_BOOL = "use true or false"
FORM_TYPES = "use a comma list of model substrings like A100,H200"
FORM_UUIDS = "use a comma list of card UUIDs like GPU-8f6c2a4e-..."
FORM_CONTAINERS = "use a comma list of the pod's container names"


@dataclass(frozen=True, slots=True)
class KeyDoc:
    """One request key, for docs/api.md."""

    key: str
    where: str  # "annotation" or "container limit"
    form: str
    meaning: str


ANNOTATION_KEYS: tuple[KeyDoc, ...] = (
    KeyDoc(
        GPU, "annotation", f"integer 1-{MAX_CARDS} (default 1)", "physical cards per container, each sliced"
    ),
    KeyDoc(
        GPUMEM,
        "annotation",
        "MiB (`3000`) or a quantity (`3Gi`, `3000Mi`); 0 = whole card",
        "memory per card",
    ),
    KeyDoc(
        GPUMEM_PERCENTAGE, "annotation", "integer 1-100", "memory as percent of each card (not with gpumem)"
    ),
    KeyDoc(GPUCORES, "annotation", "integer 0-100", "percent of the card's SMs; 100 = exclusive card"),
    KeyDoc(PRIORITY, "annotation", "`0` high, `1` low (default)", "task priority between co-located slices"),
    KeyDoc(
        CONTAINERS,
        "annotation",
        "comma list of container names",
        "containers that get slices (default: the first app container); init containers allowed",
    ),
    KeyDoc(GPU_TYPE, "annotation", "comma list", "card model must contain one item (case-insensitive)"),
    KeyDoc(EXCLUDE_GPU_TYPE, "annotation", "comma list", "card model must contain no item"),
    KeyDoc(GPU_UUID, "annotation", "comma list of `GPU-…`", "only these cards"),
    KeyDoc(EXCLUDE_GPU_UUID, "annotation", "comma list of `GPU-…`", "never these cards"),
    KeyDoc(NUMA_BIND, "annotation", "`true` / `false`", "all cards of a container on one NUMA node"),
    KeyDoc(NODE_POLICY, "annotation", "`binpack` / `spread`", "node placement, overrides the pool"),
    KeyDoc(GPU_POLICY, "annotation", "`binpack` / `spread`", "card placement, overrides the pool"),
)

HAMI_KEYS: tuple[KeyDoc, ...] = (
    KeyDoc(HAMI_GPU, "container limit", f"integer 0-{MAX_CARDS}", "cards (0 = this container asks for none)"),
    KeyDoc(
        HAMI_GPUMEM,
        "container limit",
        "MiB (`3000`, shown as `3k`) or a binary quantity (`3Gi`)",
        "memory per card",
    ),
    KeyDoc(
        HAMI_GPUMEM_PERCENTAGE,
        "container limit",
        "integer 0-100 (0 = unset)",
        "memory as percent of each card",
    ),
    KeyDoc(
        HAMI_GPUCORES,
        "container limit",
        "integer 0-100",
        "percent of the card's SMs (HAMi clamps >100; we reject)",
    ),
    KeyDoc(HAMI_PRIORITY, "container limit", "`0` / `1`", "task priority"),
    KeyDoc(HAMI_USE_TYPE, "annotation", "comma list", f"same as `{GPU_TYPE}`"),
    KeyDoc(HAMI_NOUSE_TYPE, "annotation", "comma list", f"same as `{EXCLUDE_GPU_TYPE}`"),
    KeyDoc(HAMI_USE_UUID, "annotation", "comma list", f"same as `{GPU_UUID}`"),
    KeyDoc(HAMI_NOUSE_UUID, "annotation", "comma list", f"same as `{EXCLUDE_GPU_UUID}`"),
    KeyDoc(HAMI_NUMA_BIND, "annotation", "`true` / `false`", f"same as `{NUMA_BIND}`"),
    KeyDoc(HAMI_NODE_POLICY, "annotation", "`binpack` / `spread`", f"same as `{NODE_POLICY}`"),
    KeyDoc(
        HAMI_GPU_POLICY,
        "annotation",
        "`binpack` / `spread`",
        f"same as `{GPU_POLICY}` (HAMi's topology-aware, mutex and numa are rejected)",
    ),
    KeyDoc(HAMI_VGPU_MODE, "annotation", "`hami-core`", "other modes are rejected"),
    KeyDoc(HAMI_SCORING_WEIGHTS, "annotation", "—", "not supported: rejected"),
)

AMOUNT_ANNOTATIONS = (GPU, GPUMEM, GPUMEM_PERCENTAGE, GPUCORES, PRIORITY, CONTAINERS)
REQUEST_ANNOTATIONS = tuple(k.key for k in ANNOTATION_KEYS)
HAMI_RESOURCES = (HAMI_GPU, HAMI_GPUMEM, HAMI_GPUMEM_PERCENTAGE, HAMI_GPUCORES, HAMI_PRIORITY)

# (kvgpu key, HAMi key) pairs that mean the same; both may be set only to the same value.
_SYNONYMS = (
    (GPU_TYPE, HAMI_USE_TYPE),
    (EXCLUDE_GPU_TYPE, HAMI_NOUSE_TYPE),
    (GPU_UUID, HAMI_USE_UUID),
    (EXCLUDE_GPU_UUID, HAMI_NOUSE_UUID),
    (NUMA_BIND, HAMI_NUMA_BIND),
    (NODE_POLICY, HAMI_NODE_POLICY),
    (GPU_POLICY, HAMI_GPU_POLICY),
)


def _operator_annotations() -> frozenset[str]:
    """Every ``kvgpu.io/...`` annotation name defined in :mod:`kvgpu.core.keys` (operator-owned)."""
    return frozenset(v for v in vars(keys).values() if isinstance(v, str) and v.startswith(K))


_OPERATOR_KEYS = _operator_annotations()


#: How requests are read, for docs/api.md (Markdown).
DOC_MARKDOWN = f"""\
A pod asks for slices in one of two forms; both give the same per-container request.

- **Annotation form**: `{GPU}`, `{GPUMEM}`, `{GPUMEM_PERCENTAGE}`, `{GPUCORES}`, `{PRIORITY}` on the pod
  (for a Deployment, Job, ... on `spec.template.metadata`). The request applies to each container
  named in `{CONTAINERS}` (init containers allowed), by default to the first app container. Any
  `kvgpu.io/` request annotation, even a selection one alone, makes the pod a GPU pod (1 card by default).
- **HAMi form**: container `limits` (or `requests`) `{HAMI_GPU}`, `{HAMI_GPUMEM}`, `{HAMI_GPUMEM_PERCENTAGE}`,
  `{HAMI_GPUCORES}`, `{HAMI_PRIORITY}`, per container, init containers included. `{HAMI_GPU}: 0` alone
  means no GPU for that container.

The selection and policy annotations (`{GPU_TYPE}` ... or HAMi's spelling) apply to every requesting
container in both forms. Mixing the amount annotations with `nvidia.com/*` limits is refused; so is
setting a kvgpu key and its HAMi synonym to different values. A `kvgpu.io/` key (prefix in any case)
that is a case variant or a misspelling of a request key (`kvgpu.io/GPUMEM`, `kvgpu.io/gpu-count`,
`kvgpu.io/gpumemory`) is refused naming the right key; so is a HAMi container resource written as a
pod annotation (`nvidia.com/gpumem`). Other `kvgpu.io/` keys are the operator's (allocation records)
or unknown: admitted with a warning.

**Defaults** come from the pool: before a node is chosen, the pool named `default`, else the only
pool, else HAMi's defaults (1 card, whole memory, no core limit, priority 1, binpack nodes, spread
cards). The card count is the exception for the annotation form: the mutating webhook, which knows
no pool, gives each container with slices the limit `{HAMI_GPU}: <cards>` (so that the kubelet
calls the device plugin), `{GPU}` or else 1; a `{HAMI_GPU}` limit there is the card count, and must
equal `{GPU}` when both are set.
A request that ends up with the whole card's memory and names no cores gets `gpucores: 100`
(an exclusive card) when the pool's default gpucores is 0, as in HAMi. `gpumem-percentage: 100` is the
whole card.

**Memory values**: a plain number counts MiB (`3000`); so does a number with a decimal suffix, because
the API server prints resource quantities that way (a limit of `3000` reads back as `3k`); a binary
suffix means bytes (`3Gi` = 3072 MiB, `3000Mi` = 3000 MiB) and must come to a whole number of MiB.
At most {MAX_CARD_MEMORY_MIB} MiB (1 TiB) per card, and at least the smallest `spec.minSliceMemory`
of the pools (default {DEFAULT_MIN_SLICE_MIB}; 0 = the whole card always passes). A `m` suffix is
milli (`3000m` is 3): refused; a container limit of `3000m` reaches admission as `3` and is refused
by the minimum. Quantities are parsed by the Kubernetes client
library (`kubernetes.utils.quantity.parse_quantity`).

**Sidecars** (init containers with `restartPolicy: Always`) are counted as app containers.
"""


def _is_request_annotation(key: str) -> bool:
    """A kvgpu request key, a ``kvgpu.io/`` key (prefix in any case) that looks like a misspelt
    one, or a HAMi container resource written as an annotation (:func:`misplaced_resource`).

    Other ``kvgpu.io/`` keys belong to the operator (allocation annotations, Kopf's progress and
    diff-base annotations) or are unknown (:func:`unknown_annotations`: a warning, not a request).
    """
    return key in REQUEST_ANNOTATIONS or _misspelt(key) is not None or misplaced_resource(key) is not None


#: Public name of :func:`_is_request_annotation` (admission's workload warnings use it).
is_request_key = _is_request_annotation


# Stems of the words people use for the request keys (``gpu-count``, ``gpu_mem``, ``memory``,
# ``vgpu-cores``, ...), longest first where one contains another, each with its concept; "" = a
# word that carries no meaning here (units, "use"). "gpu" and "count" both name the card count.
_STEMS: tuple[tuple[str, str], ...] = tuple(sorted((
    ("percentage", "pct"), ("percent", "pct"), ("pct", "pct"),
    ("memory", "mem"), ("vram", "mem"), ("mem", "mem"),
    ("cores", "core"), ("core", "core"), ("compute", "core"), ("utilization", "core"), ("util", "core"),
    ("priority", "prio"), ("prio", "prio"),
    ("containers", "ctr"), ("container", "ctr"),
    ("types", "type"), ("type", "type"), ("models", "type"), ("model", "type"),
    ("uuids", "uuid"), ("uuid", "uuid"),
    ("exclude", "not"), ("excluded", "not"), ("except", "not"), ("nouse", "not"), ("avoid", "not"),
    ("numa", "numa"), ("bind", "bind"),
    ("policy", "policy"), ("scheduler", "policy"), ("scheduling", "policy"), ("sched", "policy"),
    ("strategy", "policy"), ("node", "node"),
    ("number", "count"), ("count", "count"), ("cards", "count"), ("card", "count"), ("num", "count"),
    ("gpus", "count"), ("vgpus", "count"), ("vgpu", "gpu"), ("gpu", "gpu"),
    ("use", ""), ("mib", ""), ("size", ""), ("limit", ""), ("request", ""), ("amount", ""), ("per", ""),
), key=lambda s: -len(s[0])))
_CARD_WORDS = frozenset({"gpu", "count"})

# The concept sets each request key answers to (card words and meaningless words left out).
_KEY_CONCEPTS: tuple[tuple[str, tuple[frozenset[str], ...]], ...] = (
    (GPU, (frozenset(),)),
    (GPUMEM, (frozenset({"mem"}),)),
    (GPUMEM_PERCENTAGE, (frozenset({"mem", "pct"}), frozenset({"pct"}))),
    (GPUCORES, (frozenset({"core"}), frozenset({"core", "pct"}))),
    (PRIORITY, (frozenset({"prio"}),)),
    (CONTAINERS, (frozenset({"ctr"}),)),
    (GPU_TYPE, (frozenset({"type"}),)),
    (EXCLUDE_GPU_TYPE, (frozenset({"not", "type"}),)),
    (GPU_UUID, (frozenset({"uuid"}),)),
    (EXCLUDE_GPU_UUID, (frozenset({"not", "uuid"}),)),
    (NUMA_BIND, (frozenset({"numa"}), frozenset({"numa", "bind"}))),
    (NODE_POLICY, (frozenset({"node", "policy"}),)),
    (GPU_POLICY, (frozenset({"policy"}),)),
)
_NORMALISED = {re.sub(r"[^a-z0-9]", "", k.removeprefix(K)): k for k in REQUEST_ANNOTATIONS}


def _concepts(name: str) -> frozenset[str] | None:
    """The concepts of a key's name part (``gpu-count`` → {gpu, count}), from :data:`_STEMS`;
    ``None`` when some letters fit no stem (a trailing plural ``s`` aside)."""
    text = re.sub(r"[^a-z0-9]", "", name.lower())
    found: set[str] = set()
    rest = ""
    i = 0
    while i < len(text):
        stem = next((s for s in _STEMS if text.startswith(s[0], i)), None)
        if stem is None:
            rest += text[i]
            i += 1
            continue
        found.add(stem[1])
        i += len(stem[0])
    if rest not in ("", "s") or not found - {""}:
        return None
    return frozenset(found - {""})


def suggest_key(name: str) -> str | None:
    """The request key that an annotation name part (after ``kvgpu.io/``) most likely means.

    In order: the same letters in another case or with other separators (``GPUMEM``,
    ``gpu_mem``); the same concepts (``gpu-count``, ``gpus``, ``gpu_num`` → ``kvgpu.io/gpu``,
    ``gpu-memory`` → ``kvgpu.io/gpumem``, ``vgpu-cores`` → ``kvgpu.io/gpucores``); a close
    spelling of a key's letters (``priorty``, difflib ratio ≥ 0.8). ``None``: no request key.
    """
    flat = re.sub(r"[^a-z0-9]", "", name.lower())
    if flat in _NORMALISED:
        return _NORMALISED[flat]
    concepts = _concepts(name)
    if concepts is not None:
        meaning = concepts - _CARD_WORDS
        if meaning or concepts & _CARD_WORDS:
            for key, sets in _KEY_CONCEPTS:
                if meaning in sets:
                    return key
    close = difflib.get_close_matches(flat, list(_NORMALISED), n=1, cutoff=0.8)
    return _NORMALISED[close[0]] if close else None


def _ours(key: str) -> bool:
    """A ``kvgpu.io/`` key, the prefix in any case (annotation prefixes are DNS names, and the
    API server accepts them in upper case too)."""
    return key.lower().startswith(K)


def _operator_key(key: str) -> bool:
    return key in _OPERATOR_KEYS or keys.is_allocation_annotation(key)


@functools.lru_cache(maxsize=4096)
def _misspelt(key: str) -> str | None:
    """The request key that ``key`` is probably a typo or a case variant of, if any."""
    if not _ours(key) or key in REQUEST_ANNOTATIONS or _operator_key(key):
        return None
    return suggest_key(key[len(K):])


def misplaced_resource(key: str) -> str | None:
    """The HAMi container resource that annotation ``key`` names (``nvidia.com/gpumem`` in any
    case), written on the pod instead of as a container limit; else ``None``."""
    low = key.lower()
    return low if low in HAMI_RESOURCES else None


def unknown_annotations(annotations: Mapping[str, Any]) -> list[str]:
    """The ``kvgpu.io/`` keys (prefix in any case) of ``annotations`` that kvgpu does not read:
    neither a request key, nor a probable misspelling of one (those are refused), nor one the
    operator writes. Sorted. For an admission warning: they give the pod nothing."""
    return sorted(k for k in annotations if _ours(str(k)) and str(k) not in REQUEST_ANNOTATIONS
                  and not _operator_key(str(k)) and _misspelt(str(k)) is None)
