#!/usr/bin/env bash
# Issue 20: several cards on one node under the shim, in one device call, from the repository root:
#
#   bash bench/gpu/multi.sh          # results in $OUT (or bench/results/raw/multi)
#
# Builds the shim from this working tree as bench/gpu/suite.sh does (shim/build.py with its cffi
# core, else --plain-gcc; KVGPU_LIB=shim/_build/libvgpu.so), then runs bench/gpu/multi.py:
#   1 a claim over the first two cards (SLICES, default 3000 MiB / 30 % and 6000 MiB / 50 %):
#     mem_get_info, 256 MiB blocks until CUDA's OOM, NVML's per-process peak, nvidia-smi under
#     the preload, a matmul loop on each card at once (share of the native rate vs the limit)
#   2 CUDA_VISIBLE_DEVICES by index, reordered, by UUID (full, bare, abbreviated)
#   3 torchrun --nproc_per_node 2, NCCL all-reduce of 128 floats, 60 s at most
#   4 peer access and a cross-card copy, natively and under the claim
#   5 bench/gpu/discovery_check.py (the node agent's discovery vs nvidia-smi)
# With one card the 2-card checks are written as skipped. Outputs: $OUT/multi.json (every check),
# $OUT/multi.md, $OUT/multi.log, $OUT/raw/ (each child), $OUT/inventory.json.
# Exit status: multi.py's, 0 only when every check that ran passed.
# Env: PY (python3), SLICES ("3000:30,6000:50"), SECS (8, each matmul run), TOL (5 points).
# CPU only, no GPU: python3 bench/gpu/multi.py --selftest (fakes; tests/unit/test_multi_gpu.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/raw/multi}
mkdir -p "$OUT"
exec > >(tee "$OUT/multi.log") 2>&1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PY:-python3}
hdr() { echo; echo "=== $* ($(date -u +%T)) ==="; }

hdr "MULTI $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=index,uuid,name,memory.total,driver_version,pci.bus_id --format=csv
nvidia-smi topo -m 2>/dev/null
$PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
uname -r; nproc

hdr "BUILD kvgpu"
export KVGPU_LIB=$PWD/shim/_build/libvgpu.so
if ! $PY shim/build.py; then
    echo "full shim build failed: --plain-gcc"
    $PY shim/build.py --plain-gcc || { echo "kvgpu shim did not build"; exit 2; }
fi
strings "$KVGPU_LIB" | grep -m1 "^kvgpu-shim [0-9]"
echo "tree: $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | grep -c .) changed files"

hdr RUN
$PY bench/gpu/multi.py --out "$OUT" --lib "$KVGPU_LIB" --python "$PY" \
    --slices "${SLICES:-3000:30,6000:50}" --secs "${SECS:-8}" --tol "${TOL:-5}"
rc=$?
hdr "DONE exit $rc"
exit $rc
