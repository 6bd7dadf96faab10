#!/usr/bin/env bash
# The shim's tests against sanitizer builds of libvgpu.so (make check-sanitize):
#   tests/shim/sanitize.sh [address|thread ...]   (default: both; from any directory)
# Builds shim/_build/<asan|tsan>/libvgpu.so, preloads the sanitizer runtime before it, runs the
# subset of tests/shim that exercises the preloaded library (memory, fork, threads, claims; not
# the timing-bound compute workloads, which a sanitizer slows past their bounds),
# and fails when a test fails or when the sanitizer reported anything (its log files).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
CC=${CC:-gcc}
DEFAULT="tests/shim/test_fork_threads.py tests/shim/test_memory.py tests/shim/test_memory_hidden.py"
DEFAULT+=" tests/shim/test_mps.py tests/shim/test_forgery.py tests/shim/test_oversubscription.py"
read -r -a TESTS <<<"${SANITIZE_TESTS:-$DEFAULT}"
rc=0
for kind in "${@:-address thread}"; do
  for k in $kind; do
    case $k in
      address) short=asan; opts_var=ASAN_OPTIONS
               opts="detect_leaks=0:verify_asan_link_order=0:abort_on_error=0" ;;
      thread)  short=tsan; opts_var=TSAN_OPTIONS
               opts="die_after_fork=0:report_signal_unsafe=0:halt_on_error=0" ;;
      *) echo "unknown sanitizer $k" >&2; exit 2 ;;
    esac
    "$PY" shim/build.py --sanitize "$k" >/dev/null
    logs=$(mktemp -d)
    runtime=$("$CC" -print-file-name="lib$short.so")
    echo "== $k: ${TESTS[*]}"
    if ! env KVGPU_TEST_SHIM="$PWD/shim/_build/$short/libvgpu.so" KVGPU_TEST_PRELOAD="$runtime" \
        "$opts_var=$opts:log_path=$logs/$short" "$PY" -m pytest -q "${TESTS[@]}"; then
      rc=1
    fi
    if compgen -G "$logs/$short*" >/dev/null; then
      echo "== $k reported (first 200 lines of each log):" >&2
      for f in "$logs/$short"*; do echo "--- $f" >&2; head -200 "$f" >&2; done
      rc=1
    fi
    rm -rf "$logs"
  done
done
exit $rc
