#!/usr/bin/env bash
# Runs the scale bench on a remote machine without internet (nor make, nor .venv) from the
# bundle that hack/device_bundle.sh made: carry .whl and .ktp, run from the repository root:
#   bash bench/scale/device.sh --nodes 1000 --bursts 500,2000 --requeue-trials 20
#   bash bench/scale/device.sh --nodes 1000 --dra -- --nodes 5000 --requeue-trials 0
# Arguments go to bench/scale/run.py; `--` separates the arguments of runs made one after the
# other (the setup is done once). Writes into $OUT (default /tmp/kvgpu-out): scale.json (every
# run merged, keyed as bench/results/scale.json), and per run run.log and logs.tar.gz (the run
# directory's component logs, each cut to its last 5 MB, and the profiles and traces asked for; one
# archive because only a few files come back from $OUT), named run-<k>.log and logs-<k>.tar.gz
# (k = 1, 2, ...) when there are several runs. Exit status: the first non-zero run.py's, else 0.
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

# The bench, once per argument group. A fixed run directory (wiped first, kept after) so the
# logs can be collected.
groups=() cur=()
for a in "$@"; do
  if [ "$a" = "--" ]; then groups+=("${cur[*]}"); cur=(); else cur+=("$a"); fi
done
groups+=("${cur[*]}")
rc=0 k=0
for g in "${groups[@]}"; do
  k=$((k + 1)); sfx=""; [ "${#groups[@]}" -gt 1 ] && sfx="-$k"
  rm -rf "$RUN"
  r=0
  # shellcheck disable=SC2086  # $g is the run's argument list on purpose (options hold no spaces)
  PYTHONUNBUFFERED=1 python3 bench/scale/run.py --out "$OUT/scale.json" --run-dir "$RUN" --keep $g 2>&1 |
    tee "$OUT/run$sfx.log" || r=$?
  [ "$rc" -ne 0 ] || rc=$r
  # Logs of every component (operator, both schedulers, apiserver, etcd), partial results and
  # the profiles and traces asked for.
  if [ -d "$RUN" ]; then
    rm -rf /tmp/kvgpu-logs && mkdir -p /tmp/kvgpu-logs
    for f in "$RUN"/logs/* "$RUN"/*.json "$RUN"/*.txt; do
      [ -f "$f" ] && tail -c 5000000 "$f" >"/tmp/kvgpu-logs/$(basename "$f")"
    done
    for f in "$RUN"/*.pprof "$RUN"/*.trace; do  # --*-profile, --scheduler-trace: whole, or unreadable
      [ -f "$f" ] && cp "$f" /tmp/kvgpu-logs/
    done
    tar -C /tmp -czf "$OUT/logs$sfx.tar.gz" kvgpu-logs
  fi
  echo "device.sh: run $k ($g) exited $r"
done
echo "device.sh: $OUT holds: $(ls "$OUT" | tr '\n' ' ')"
exit "$rc"
