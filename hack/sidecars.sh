#!/usr/bin/env bash
# Builds the CSI sidecars the cluster suite runs beside our plugin:
#  - the real external-attacher (cmd/csi-attacher) from the Go module
#    proxy, with its own go.mod (never the driver's), the version the chart
#    uses if served, else the newest served;
#  - our stand-ins of csi-provisioner, csi-resizer,
#    csi-node-driver-registrar and livenessprobe (e2e/standins/), which
#    take the chart's flags (the module proxy serves no real ones).
# All static, into ${MPNBD_SIDECAR_CACHE:-/var/cache/mpnbd/sidecars}/<attacher version>/.
# The attacher is cached; the stand-ins are rebuilt from this tree on every
# run (the Go build cache makes that quick). Prints SIDECARS=<dir>.
set -euo pipefail
cd "$(dirname "$0")/.."
MODULE=github.com/kubernetes-csi/external-attacher/v4
WANT=${ATTACHER_VERSION:-v4.11.0}
ROOT=${MPNBD_SIDECAR_CACHE:-/var/cache/mpnbd/sidecars}
STANDINS=(csi-provisioner csi-resizer csi-node-driver-registrar livenessprobe)
mkdir -p "$ROOT"

# moddir VERSION prints the module's source directory, empty when the
# proxy does not serve that version.
moddir() {
  go mod download -json "$MODULE@$1" 2>/dev/null | sed -n 's/.*"Dir": "\(.*\)".*/\1/p' || true
}

version=$WANT
# A fallback chosen before (WANT not served) is remembered.
if [ -f "$ROOT/resolved-$WANT" ] && [ -x "$ROOT/$(cat "$ROOT/resolved-$WANT")/csi-attacher" ]; then
  version=$(cat "$ROOT/resolved-$WANT")
fi
if [ -x "$ROOT/$version/csi-attacher" ]; then
  src=cached
else
  src=$(moddir "$version")
  if [ -z "$src" ]; then
    # The newest served version, preferring one already built.
    latest=$(go list -m -versions "$MODULE" | tr ' ' '\n' | grep -E '^v[0-9]+\.[0-9]+\.[0-9]+$' | sort -V | tail -n1)
    [ -n "$latest" ] || { echo "the module proxy serves no $MODULE" >&2; exit 1; }
    echo "$MODULE@$WANT is not served; using $latest" >&2
    version=$latest
    if [ -x "$ROOT/$version/csi-attacher" ]; then
      src=cached
    else
      src=$(moddir "$version")
      [ -n "$src" ] || { echo "cannot download $MODULE@$version" >&2; exit 1; }
    fi
  fi
fi

CACHE=$ROOT/$version
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

if [ ! -x "$CACHE/csi-attacher" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # The module cache is read-only; build a writable copy with the
  # module's own go.mod and go.sum (its replace directives apply only
  # when it is the main module).
  cp -r "$src" "$work/src"
  chmod -R u+w "$work/src"
  echo "building csi-attacher $version (cold: a few minutes)" >&2
  (cd "$work/src" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath \
    -ldflags "-s -w -X main.version=$version" -o "$CACHE/csi-attacher.tmp" ./cmd/csi-attacher)
  mv "$CACHE/csi-attacher.tmp" "$CACHE/csi-attacher"
fi
[ "$version" = "$WANT" ] || echo "$version" > "$ROOT/resolved-$WANT"

for s in "${STANDINS[@]}"; do
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$CACHE/$s.tmp" "./e2e/standins/$s"
  mv "$CACHE/$s.tmp" "$CACHE/$s"
done
echo "SIDECARS=$CACHE"
