#!/usr/bin/env bash
# The shim's own cost per call, on a CPU: the stub driver in null-launch mode (a launch is a
# function call), so what remains is the hook. Configurations interleaved, ROUNDS rounds.
#
#   bench/gpu/cpu_hook_bench.sh [N]      (from the repository root; needs gcc and the venv)
#   LIB=path/libvgpu.so bench/gpu/cpu_hook_bench.sh   (another build, e.g. before a change)
#
# Prints ns per cuLaunchKernel, 2 MiB alloc+free and cuMemGetInfo for: native (no preload),
# shim without a claim, memory limit only, memory + compute limit (one 9.9 s window, so the
# per-launch check alone is measured).
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:-5000000}
ROUNDS=${ROUNDS:-5}
[ -f shim/_build/libvgpu.so ] || .venv/bin/python shim/build.py --plain-gcc >/dev/null
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
gcc -O2 -fPIC -shared -Wl,-Bsymbolic -pthread -o "$D/libcuda.so.1" tests/shim/stub/libcuda_stub.c
gcc -O2 -fPIC -shared -Wl,-Bsymbolic -o "$D/libnvidia-ml.so.1" tests/shim/stub/libnvml_stub.c
gcc -O2 -o "$D/cuprog" tests/shim/prog/cuprog.c -ldl "$D/libcuda.so.1"
export LD_LIBRARY_PATH=$D STUB_STATE=$D/state STUB_NULL_LAUNCH=1 STUB_MEM_MIB=200000
LIB=${LIB:-$PWD/shim/_build/libvgpu.so}
U=GPU-5a110000-0000-0000-0000-000000000000
one() { "$@" "$D/cuprog" bench "$N"; }
for r in $(seq "$ROUNDS"); do
    mkdir -p "$D/r$r" "$D/g$r"  # one region per claim (the first claim fixes a region)
    echo "native    $(one env)"
    echo "shim-off  $(one env LD_PRELOAD="$LIB")"
    echo "mem       $(one env LD_PRELOAD="$LIB" KVGPU_REGION_DIR="$D/r$r" KVGPU_CLAIM="v1;claim=b/m;dev=$U,100000,0")"
    echo "mem+gate  $(one env LD_PRELOAD="$LIB" KVGPU_REGION_DIR="$D/g$r" KVGPU_COMPUTE_PERIOD_MS=10000 KVGPU_CLAIM="v1;claim=b/g;dev=$U,100000,99")"
done
