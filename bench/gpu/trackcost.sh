#!/usr/bin/env bash
# CPU time per launch that gap tracking adds, on a GPU machine: suite_cu's `trackcost` natively
# (the driver's parts: a launch, an event record behind it, a query before it, an untimed event,
# cuStreamIsCapturing), then under the kvgpu shim at a 95 % limit (alone on the card, so the
# limit never binds) built four ways: as shipped (one batch in two gap-tracked), every batch
# tracked, none tracked, one batch in four tracked. The shim's "launch_us" is then the whole
# hooked launch.
#
# Device call, from the repository root:  bash bench/gpu/trackcost.sh     (results in $OUT)
# Env: ITERS (1: ~2 us kernels, a launch-bound loop), N (20000 launches per measurement), ROUNDS (3).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/raw/trackcost}
mkdir -p "$OUT"
W=$(mktemp -d)
gcc -O2 -Wall -pthread -o "$W/suite_cu" bench/gpu/suite_cu.c -ldl || exit 1
uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nproc; lscpu | grep -m1 'Model name'
run() { # label, then env assignments
    local label=$1; shift
    for r in $(seq 1 "${ROUNDS:-3}"); do
        printf '%s %s ' "$label" "$r"
        env "$@" "$W/suite_cu" trackcost "${ITERS:-1}" "${N:-20000}"
    done
}
run native | tee "$OUT/trackcost.txt"
for v in shipped:"" every:"-DVGPU_TRACK_EVERY=1u" none:"-DVGPU_TRACK_EVERY=1000000u" \
    quarter:"-DVGPU_TRACK_EVERY=4u"; do
    name=${v%%:*} flags=${v#*:}
    rm -rf "$W/tree" && mkdir -p "$W/tree" && git archive HEAD operator/kvgpu | tar -x -C "$W/tree"
    cp -r shim "$W/tree/" # this working tree's shim, committed or not
    (cd "$W/tree" && VGPU_CFLAGS="$flags" python3 shim/build.py --plain-gcc >/dev/null) || { echo "build $name failed"; continue; }
    mkdir -p "$W/region-$name"
    run "kvgpu-$name" LD_PRELOAD="$W/tree/shim/_build/libvgpu.so" KVGPU_REGION_DIR="$W/region-$name" \
        KVGPU_CLAIM="v1;claim=bench/trackcost-$name;priority=1;dev=$uuid,8000,95" | tee -a "$OUT/trackcost.txt"
done
