#!/usr/bin/env bash
# Packs what bench/gpu/suite.sh needs on the GPU machine (no internet there) into .hami/
# (git-ignored; carry it: the run tool's carry [".hami"], well under its 64 MiB):
#   hami-core.tar.xz    HAMi-core's sources at a pinned commit (its CMake files, src/, README)
#   kvgpu-tree.tar.xz   `git archive HEAD` of shim/ and operator/kvgpu: the committed kvgpu code
#                       the suite measures (the working tree may hold others' half-done edits)
#   wheels/             cffi + pycparser for CPython 3.12: the node agent's Scheduler reads the
#                       shims' regions through the shim's cffi core
#
#   bash bench/gpu/suite_bundle.sh HAMI_CORE_GIT_DIR [COMMIT]
# HAMI_CORE_GIT_DIR: a clone (or bare mirror) of github.com/Project-HAMi/HAMi-core.
# KVGPU_REV (default HEAD): the kvgpu commit to measure.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=${1:?usage: suite_bundle.sh HAMI_CORE_GIT_DIR [COMMIT]}
commit=${2:-8f3a89c67b037d8fdfe6c4cd4d8c4f0cd6504811}
mkdir -p .hami/wheels
git -C "$src" archive --format=tar "$commit" CMakeLists.txt build.sh src README.md | xz -9 >.hami/hami-core.tar.xz
git -C "$src" rev-parse "$commit^{commit}" >.hami/hami-core.commit
rev=${KVGPU_REV:-HEAD}
git archive --format=tar "$rev" shim operator/kvgpu | xz -9 >.hami/kvgpu-tree.tar.xz
git rev-parse "$rev^{commit}" >.hami/kvgpu-tree.commit
rm -f .hami/wheels/*.whl
if ls .whl/cffi-*-cp312-*.whl .whl/pycparser-*.whl >/dev/null 2>&1; then
    cp .whl/cffi-*-cp312-*.whl .whl/pycparser-*.whl .hami/wheels/
else
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .hami/wheels cffi pycparser
fi
du -sh .hami
