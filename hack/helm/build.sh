#!/usr/bin/env bash
# Builds the Helm CLI (helm.sh/helm/v3) from the Go module proxy, pinned below. The result is
# cached outside the work tree, keyed by Helm version, Go version and this script's hash:
#   ${KVGPU_CACHE:-~/.cache/kvgpu}/helm/<key>/helm
# Prints the binary's path on the last line of stdout. Needs Go (GOTOOLCHAIN=local) and the
# module proxy; nothing else from the internet.
set -euo pipefail
HELM_VERSION=v3.22.0
here=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
if ! command -v go >/dev/null; then
  echo "helm: no Go toolchain on PATH; install Go 1.26" >&2
  exit 1
fi
GOV=$(go env GOVERSION)
SUM=$(sha256sum "$here/build.sh" | cut -c1-12)
KEY="$HELM_VERSION-$GOV-$SUM"
OUT="${KVGPU_CACHE:-$HOME/.cache/kvgpu}/helm/$KEY"
if [ -x "$OUT/helm" ] && [ -f "$OUT/.complete" ]; then
  echo "$OUT/helm"; exit 0
fi
mkdir -p "$OUT"
echo "helm: building helm $HELM_VERSION with $GOV into $OUT (a cold build takes a few minutes)" >&2
start=$(date +%s)
LDF="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
if ! GOBIN="$OUT" go install -trimpath -ldflags "$LDF" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" 2>"$OUT/build.log"; then
  echo "helm: go install failed; the last lines of $OUT/build.log:" >&2
  tail -20 "$OUT/build.log" >&2
  exit 1
fi
"$OUT/helm" version --short >&2
echo "helm: built in $(( $(date +%s) - start )) s" >&2
touch "$OUT/.complete"
echo "$OUT/helm"
