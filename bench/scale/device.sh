#!/usr/bin/env bash
# Runs the scale bench on a remote machine without internet (nor make, nor .venv) from the
# bundle that hack/device_bundle.sh made: carry .whl and .ktp, run from the repository root:
#   bash bench/scale/device.sh --nodes 1000 --bursts 500,2000 --requeue-trials 20
# Arguments go to bench/scale/run.py. Writes into $OUT (default /tmp/kvgpu-out): scale.json,
# run.log and logs.tar.gz (the run directory's component logs, each cut to its last 5 MB; one
# archive because only a few files come back from $OUT). Exit status is run.py's.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
OUT=${OUT:-/tmp/kvgpu-out}
SITE=/tmp/site KTP=/tmp/ktp RUN=/tmp/kvgpu-run
mkdir -p "$OUT"

# Python dependencies the image lacks: installed beside (not into) its venv, found via PYTHONPATH.
# ./operator holds kvgpu itself (not installed); the operator subprocess needs it on the path too.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
export PYTHONPATH="$root/operator:$SITE"

# Control-plane binary: one multi-call executable, dispatched on argv[0] via the symlinks.
# Python's lzma rather than xz(1), which the image may lack.
mkdir -p "$KTP"
python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"), 1 << 20)' \
  .ktp/ktp.xz "$KTP/ktp"
chmod +x "$KTP/ktp"
for c in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl; do ln -sf ktp "$KTP/$c"; done
export KVGPU_KTP_BIN=$KTP

# What this machine is, and a fail-fast import of everything the bench and the operator load,
# so a missing or mismatched wheel shows as one named import error, not a hung control plane.
echo "nproc $(nproc); $(python3 -VV); $("$KTP/kube-apiserver" --version)"
python3 - "$SITE" <<'EOF'
import importlib, sys, tomllib, traceback
from importlib.metadata import PackageNotFoundError, distributions, version
from packaging.requirements import Requirement
sys.path.insert(0, ".")
for m in ("kopf", "kubernetes", "kubernetes_asyncio", "pydantic", "structlog", "cryptography", "cffi",
          "tenacity", "pynvml", "kvgpu.runtime", "kvgpu.cli.main", "kvgpu.devcluster.system",
          "kvgpu.extender.schedconfig", "kvgpu.dra.slices", "bench.scale.kubeio", "bench.scale.dra"):
    try:
        importlib.import_module(m)
    except Exception:
        traceback.print_exc()
        sys.exit(f"device.sh: import {m} failed (a wheel missing from .whl, or the image's copy too old?)")
# Warn (not fail) where an image-provided package is outside what kvgpu or a carried wheel asks.
reqs = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
reqs += [r for d in distributions(path=[sys.argv[1]]) for r in d.requires or []]
for r in map(Requirement, reqs):
    if r.marker and not r.marker.evaluate({"extra": ""}):
        continue
    try:
        v = version(r.name)
    except PackageNotFoundError:
        print(f"device.sh: WARNING {r.name} not installed (needed: {r})")
        continue
    if not r.specifier.contains(v, prereleases=True):
        print(f"device.sh: WARNING {r.name} {v} does not satisfy {r}")
print("device.sh: imports ok")
EOF

# The bench. A fixed run directory (wiped first, kept after) so the logs can be collected.
rm -rf "$RUN"
rc=0
PYTHONUNBUFFERED=1 python3 bench/scale/run.py --out "$OUT/scale.json" --run-dir "$RUN" --keep "$@" 2>&1 |
  tee "$OUT/run.log" || rc=$?

# Logs of every component (operator, both schedulers, apiserver, etcd) plus partial results.
if [ -d "$RUN" ]; then
  rm -rf /tmp/kvgpu-logs && mkdir -p /tmp/kvgpu-logs
  for f in "$RUN"/logs/* "$RUN"/*.json "$RUN"/*.txt; do
    [ -f "$f" ] && tail -c 5000000 "$f" >"/tmp/kvgpu-logs/$(basename "$f")"
  done
  tar -C /tmp -czf "$OUT/logs.tar.gz" kvgpu-logs
fi
echo "device.sh: run.py exited $rc; $OUT holds: $(ls "$OUT" | tr '\n' ' ')"
exit "$rc"
