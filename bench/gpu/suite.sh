#!/usr/bin/env bash
# The workload suite (issue 21 item 4) on a GPU machine: every workload natively, under
# HAMi-core and under kvgpu, in one call.
#
# Here, once:  bash bench/gpu/suite_bundle.sh HAMI_CORE_GIT_DIR    (fills the git-ignored .hami/)
# Device call (carry [".hami"]), from the repository root:
#   bash bench/gpu/suite.sh          # results in $OUT (or bench/results/raw/suite)
#
# Builds, then runs bench/gpu/suite.py (the plan, the NVML sampler, tables, plot):
#   kvgpu     shim/build.py from .hami/kvgpu-tree.tar.xz (the committed code; KVGPU_TREE_TAR=""
#             uses this working tree instead), with its cffi core when cffi and Python's headers
#             are there (the agent's Scheduler then runs as on a node), else --plain-gcc
#   suite_cu  gcc, no CUDA headers (bench/gpu/suite_cu.c)
#   HAMi-core its own CMake, build.sh's options and Debug type (what HAMi's images ship), two
#             build-configuration adjustments: CMAKE_POLICY_VERSION_MINIMUM=3.5 for CMake 4 and
#             libcuda.so/libnvidia-ml.so link names for the driver's .so.1 files; its test/
#             folder (FindCUDA, nvcc) is not configured. If CMake fails: gcc with the same flags.
# Env (see suite.py): MODES ("native hami kvgpu"), PARTS ("memory startup single group"), ONLY,
# SECS (4), SUITE_BUDGET_S (seconds for the whole script; what no longer fits is skipped and
# recorded so), BASELINE (an earlier results.json for the native numbers), PY.
set -uo pipefail
cd "$(dirname "$0")/../.."
export SUITE_T0
SUITE_T0=$(date +%s.%N)
OUT=${OUT:-bench/results/raw/suite}
mkdir -p "$OUT"
exec > >(tee "$OUT/suite.log") 2>&1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PY:-python3}
case $PY in /*) ;; */*) PY=$PWD/$PY ;; esac
MODES=${MODES:-"native hami kvgpu"}
export MODES
W=$(mktemp -d)
hdr() { echo; echo "=== $* ($(date -u +%T)) ==="; }

hdr "SUITE $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=uuid,name,memory.total,driver_version,clocks.max.sm --format=csv
$PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
nproc; uname -r; cmake --version 2>/dev/null | head -1; gcc --version | head -1

hdr "BUILD kvgpu"
KVGPU_TREE_TAR=${KVGPU_TREE_TAR-.hami/kvgpu-tree.tar.xz}
if [ -n "$KVGPU_TREE_TAR" ] && [ -f "$KVGPU_TREE_TAR" ]; then
    KVGPU_TREE=$W/kvgpu
    mkdir -p "$KVGPU_TREE" && tar -xJf "$KVGPU_TREE_TAR" -C "$KVGPU_TREE"
    echo "kvgpu tree: $KVGPU_TREE_TAR, commit $(cat .hami/kvgpu-tree.commit 2>/dev/null)"
else
    KVGPU_TREE=$PWD
    echo "kvgpu tree: this working tree ($(git rev-parse --short HEAD 2>/dev/null) + local changes)"
fi
export KVGPU_TREE
if ! $PY -c 'import cffi' 2>/dev/null && ls .hami/wheels/*.whl >/dev/null 2>&1; then
    for w in .hami/wheels/*.whl; do $PY -m zipfile -e "$w" "$W/site"; done
    export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export KVGPU_LIB=$KVGPU_TREE/shim/_build/libvgpu.so
if ! (cd "$KVGPU_TREE" && $PY shim/build.py); then
    echo "full shim build failed: --plain-gcc (the schedule is then written once per run)"
    if ! (cd "$KVGPU_TREE" && $PY shim/build.py --plain-gcc); then
        echo "kvgpu shim did not build: kvgpu mode left out"
        MODES=${MODES//kvgpu/}
    fi
fi
[ -f "$KVGPU_LIB" ] && strings "$KVGPU_LIB" | grep -m1 "^kvgpu-shim [0-9]"

hdr "BUILD suite_cu"
export SUITE_CU=$W/suite_cu
gcc -O2 -Wall -pthread -o "$SUITE_CU" bench/gpu/suite_cu.c -ldl || exit 1

export HAMI_LIB=""
if [[ " $MODES " == *" hami "* ]]; then
    hdr "BUILD HAMi-core"
    H=$W/hami
    mkdir -p "$H/src" "$H/lib"
    if tar -xJf "${HAMI_TAR:-.hami/hami-core.tar.xz}" -C "$H/src"; then
        echo "HAMi-core commit $(cat .hami/hami-core.commit 2>/dev/null)"
        CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
        [ -f "$CUDA_HOME/include/cuda.h" ] || CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
        for l in libcuda libnvidia-ml; do
            p=$(ldconfig -p | awk -v n="$l.so.1" '$1 == n {print $NF; exit}')
            ln -sf "$p" "$H/lib/$l.so"
        done
        sed -i 's/^add_subdirectory(test)/# add_subdirectory(test)/' "$H/src/CMakeLists.txt"
        mkdir -p "$H/src/build"
        (cd "$H/src/build" && CUDA_HOME=$CUDA_HOME LIBRARY_PATH=$H/lib cmake .. -DDLSYM_HOOK_ENABLE=1 \
            -DMULTIPROCESS_LIMIT_ENABLE=1 -DHOOK_MEMINFO_ENABLE=1 -DHOOK_NVML_ENABLE=1 -DCMAKE_BUILD_TYPE=Debug \
            -DTEST_DEVICE_ID=0 -DCMAKE_POLICY_VERSION_MINIMUM=3.5 >"$OUT/hami-cmake.log" 2>&1 &&
            LIBRARY_PATH=$H/lib make -j"$(nproc)" vgpu >>"$OUT/hami-cmake.log" 2>&1)
        if [ -f "$H/src/build/libvgpu.so" ]; then
            HAMI_LIB=$H/src/build/libvgpu.so
            echo "HAMi-core: built with its CMake (Debug)"
        else
            echo "HAMi-core CMake build failed (tail of $OUT/hami-cmake.log):"; tail -15 "$OUT/hami-cmake.log"
            mkdir -p "$H/fb/config"
            printf '#define MULTIPROCESS_LIMIT_ENABLE\n#define DLSYM_HOOK_ENABLE\n#define HOOK_MEMINFO_ENABLE\n#define HOOK_NVML_ENABLE\nextern size_t GIT_HASH_;\nextern size_t GIT_BRANCH_unknown;\n' \
                >"$H/fb/config/static_config.h"
            S=$H/src/src
            gcc -shared -fPIC -g -D_GNU_SOURCE -Wall -I"$CUDA_HOME/include" -I"$H/src/src" -I"$H/fb/config" \
                -o "$H/fb/libvgpu.so" "$S"/libvgpu.c "$S"/utils.c "$S"/log_utils.c "$S"/nvml/*.c "$S"/cuda/*.c \
                "$S"/allocator/*.c "$S"/multiprocess/multiprocess_memory_limit.c \
                "$S"/multiprocess/multiprocess_utilization_watcher.c -L"$H/lib" -lcuda -lnvidia-ml \
                >"$OUT/hami-gcc.log" 2>&1 && HAMI_LIB=$H/fb/libvgpu.so && echo "HAMi-core: built with gcc (Debug flags)"
            [ -n "$HAMI_LIB" ] || { echo "HAMi-core gcc build failed:"; tail -15 "$OUT/hami-gcc.log"; }
        fi
        [ -n "$HAMI_LIB" ] && echo "exported cu*/nvml* symbols: $(nm -D --defined-only "$HAMI_LIB" | grep -c -E ' (cu|nvml)')"
    else
        echo "no HAMi-core sources (.hami/hami-core.tar.xz): run bench/gpu/suite_bundle.sh here first"
    fi
fi
export HAMI_LIB

hdr "RUN"
$PY bench/gpu/suite.py --out "$OUT"
echo "suite.py exit $?"
# A device call brings back at most 8 files of $OUT: the per-run logs (and HAMi-core's build
# logs) travel as one archive, the raw samples compressed (suite.py --merge and --report read
# raw.json.xz). SUITE_PACK=0 leaves them as they are.
if [ "${SUITE_PACK:-1}" = 1 ] && [ -d "$OUT/logs" ]; then
    packed=(logs)
    for f in "$OUT"/hami-*.log; do [ -e "$f" ] && packed+=("$(basename "$f")"); done
    tar -C "$OUT" -cJf "$OUT/logs.tar.xz" "${packed[@]}" && (cd "$OUT" && rm -rf "${packed[@]}")
    [ -f "$OUT/raw.json" ] && xz -f "$OUT/raw.json"
    echo "packed: $OUT/logs.tar.xz (${packed[*]}), $OUT/raw.json.xz"
fi
hdr DONE
