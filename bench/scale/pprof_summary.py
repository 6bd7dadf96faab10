"""Summarise kube-apiserver CPU profiles (``run.py --apiserver-profile``, Go pprof) into where its
CPU goes: one line per activity, its share of the samples. Each sample counts once, for the first
activity of the list below that one of its frames belongs to (so a claim create's etcd write
counts as the claim create, and the webhook's TLS handshake as the webhook call). Needs ``go``.

    .venv/bin/python bench/scale/pprof_summary.py <run-dir>/apiserver-gpu-*.pprof
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys

CRD = "apiextensions-apiserver/pkg/apiserver.(*crdHandler)"
POLICY = "admission/plugin/policy/validating."
# (activity, substrings of Go function names that all mark it); the first that matches wins
ACTIVITIES: list[tuple[str, tuple[str, ...]]] = [
    ("admission: kvgpu's mutating webhook call (request, TLS, JSON patch, decode)",
     ("mutating.(*mutatingDispatcher).callAttrMutatingHook",)),
    ("admission: webhooks' matchConditions (CEL)", ("generic.(*Webhook).ShouldCallHook",)),
    ("admission: the VGPUClaim policy (CEL)", (POLICY, CRD)),
    ("admission: the pod policy (CEL)", (POLICY,)),
    ("admission: validating webhook calls", ("validating.(*validatingDispatcher)",)),
    ("VGPUClaim create (custom resource handler)", (CRD,)),
    ("pod Binding", ("storage.(*BindingREST)",)),
    ("PATCH (pod status)", ("handlers.PatchResource",)),
    ("other creates (pods, Events: decode, defaults, managed fields, storage)", ("handlers.CreateResource",)),
    ("watch fan-out (watch cache, watch streams)", ("apiserver/pkg/storage/cacher",)),
    ("watch fan-out (watch cache, watch streams)", ("handlers.(*WatchServer)",)),
    ("etcd client (other)", ("apiserver/pkg/storage/etcd3",)),
    ("TLS handshakes (other)", ("crypto/tls.(*Conn).HandshakeContext",)),
    ("Go garbage collector", ("runtime.gcBgMarkWorker",)),
]
OTHER = "other (request filters, authn/z, serialisation, scheduling)"
VALUE = re.compile(r"^\s*([0-9.]+)(ns|us|µs|ms|s)\s+(\S.*)$")
UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_traces(text: str) -> list[tuple[float, list[str]]]:
    """(CPU seconds, frames leaf first) of every stack in ``go tool pprof -traces`` output."""
    out: list[tuple[float, list[str]]] = []
    for block in text.split("-----------+")[1:]:
        lines = [ln for ln in block.splitlines()[1:] if ln.strip()]
        if not lines or not (m := VALUE.match(lines[0])):
            continue
        frames = [m.group(3).strip()] + [ln.strip() for ln in lines[1:]]
        out.append((float(m.group(1)) * UNIT[m.group(2)], frames))
    return out


def shares(stacks: list[tuple[float, list[str]]]) -> dict[str, float]:
    """Share (percent) of the stacks' CPU per activity, and ``_cpu_s`` in all."""
    counts: collections.defaultdict[str, float] = collections.defaultdict(float)
    total = 0.0
    for secs, frames in stacks:
        total += secs
        for label, marks in ACTIVITIES:
            if all(any(m in f for f in frames) for m in marks):
                counts[label] += secs
                break
        else:
            counts[OTHER] += secs
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return {k: round(100 * v / total, 1) for k, v in ranked} | {"_cpu_s": round(total, 2)}


def summarise(paths: list[str]) -> dict[str, float]:
    """:func:`shares` of the profiles at ``paths`` (read with ``go tool pprof -traces``)."""
    text = subprocess.run(["go", "tool", "pprof", "-traces", *paths], capture_output=True, text=True,
                          check=True).stdout
    return shares(parse_traces(text))


if __name__ == "__main__":
    print(json.dumps(summarise(sys.argv[1:]), indent=1, ensure_ascii=False))
