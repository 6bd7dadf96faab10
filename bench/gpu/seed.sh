#!/usr/bin/env bash
# The seed walk-through, GPU half (the control-plane half is bench/gpu/seed_claim.py, run here first):
# under exactly the claim the operator wrote for the seed pod (bench/gpu/seed-claim.env, the values
# the downward API puts in KVGPU_CLAIM and NVIDIA_VISIBLE_DEVICES, plus the claim file), run
#   - the agent's NVML discovery check against nvidia-smi,
#   - nvidia-smi native and under the shim (expect "… / 3000MiB"),
#   - torch allocating 256 MiB blocks (expect torch.OutOfMemoryError below 3000 MiB),
#   - a saturating matmul loop native and under the 30 % claim (expect about 30 % of native).
#
#   bench/gpu/seed.sh        (repository root, on the H200 machine; output to $OUT or bench/results/raw)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/raw}; mkdir -p "$OUT"
PY=${PY:-python3}
SECS=${SECS:-10}
exec > >(tee "$OUT/seed.log") 2>&1
hdr() { echo; echo "=== $* ==="; }

hdr "SEED $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=uuid,index,name,memory.total,driver_version --format=csv
REAL=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
set -a; . bench/gpu/seed-claim.env; set +a
if [ "$NVIDIA_VISIBLE_DEVICES" != "$REAL" ]; then
    echo "NOTE: the claim names $NVIDIA_VISIBLE_DEVICES but this machine's card is $REAL"
    echo "      (a fresh device machine); substituting the UUID, nothing else changes"
    KVGPU_CLAIM=${KVGPU_CLAIM//$NVIDIA_VISIBLE_DEVICES/$REAL}; NVIDIA_VISIBLE_DEVICES=$REAL
fi
echo "KVGPU_CLAIM=$KVGPU_CLAIM"
echo "NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES"

hdr BUILD
$PY shim/build.py --plain-gcc || exit 1
LIB=$PWD/shim/_build/libvgpu.so

hdr "DISCOVERY CHECK (agent NVML discovery vs nvidia-smi)"
$PY bench/gpu/discovery_check.py --json "$OUT/inventory.json"; echo "discovery_check exit $?"

RD=$(mktemp -d); CF=$(mktemp); printf '%s' "$KVGPU_CLAIM" > "$CF"
under() { env LD_PRELOAD="$LIB" KVGPU_REGION_DIR="$RD" KVGPU_CLAIM_FILE="$CF" KVGPU_CLAIM="$KVGPU_CLAIM" \
              NVIDIA_VISIBLE_DEVICES="$NVIDIA_VISIBLE_DEVICES" "$@"; }

hdr "nvidia-smi native"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv
hdr "nvidia-smi under the seed claim"
under timeout -k 2 30 nvidia-smi
under timeout -k 2 30 nvidia-smi --query-gpu=memory.used,memory.total --format=csv

hdr "torch 256 MiB blocks under the seed claim"
under timeout -k 2 90 $PY bench/gpu/memtest.py 256 --smi

hdr "matmul native ${SECS}s"
timeout -k 2 60 $PY bench/gpu/matmul.py "$SECS" native | tee "$OUT/seed-native.json"
hdr "matmul under the seed claim (30 %) ${SECS}s"
under timeout -k 2 60 $PY bench/gpu/matmul.py "$SECS" seed30 | tee "$OUT/seed-30.json"
$PY - "$OUT/seed-native.json" "$OUT/seed-30.json" <<'PYEOF'
import json, sys
n = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
s = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
key = "its"
print(f"seed 30 % claim: {100 * s[key] / n[key]:.1f} % of native matmul throughput")
PYEOF
hdr "DONE $(date -u +%FT%TZ)"
