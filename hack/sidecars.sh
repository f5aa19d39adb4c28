#!/usr/bin/env bash
# Builds the CSI sidecars the cluster suite runs beside our plugin:
#  - the real external-provisioner, external-attacher and external-resizer
#    (cmd/csi-provisioner, cmd/csi-attacher, cmd/csi-resizer) from the Go
#    module proxy, each with its own go.mod (never the driver's), at the
#    version charts/mpnbd/values.yaml runs (PROVISIONER_VERSION,
#    ATTACHER_VERSION, RESIZER_VERSION override it); a version the proxy
#    does not serve falls back, with a warning, to the newest it serves;
#  - our stand-ins of csi-node-driver-registrar and livenessprobe
#    (e2e/standins/, in the e2e module), which take the chart's flags (the module proxy serves
#    no real ones).
# All static. The real ones are built once into
# ${MPNBD_SIDECAR_CACHE:-/var/cache/mpnbd/sidecars}/<command>/<version>/
# (cold: a few minutes each); the stand-ins are rebuilt from this tree on
# every run (the Go build cache makes that quick). Prints SIDECARS=<dir>,
# a directory holding the five commands.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${MPNBD_SIDECAR_CACHE:-/var/cache/mpnbd/sidecars}
STANDINS=(csi-node-driver-registrar livenessprobe)
mkdir -p "$ROOT"

# chartVersion IMAGE prints the tag of registry.k8s.io/sig-storage/IMAGE in
# the chart's values.
chartVersion() {
  local v
  v=$(sed -n "s|^ *image: registry.k8s.io/sig-storage/$1:\(v[0-9][0-9.]*\) *$|\1|p" charts/mpnbd/values.yaml)
  [ -n "$v" ] || { echo "charts/mpnbd/values.yaml names no $1 image" >&2; exit 1; }
  echo "$v"
}

# moddir MODULE VERSION prints the module's source directory, empty when
# the proxy does not serve that version.
moddir() {
  go mod download -json "$1@$2" 2>/dev/null | sed -n 's/.*"Dir": "\(.*\)".*/\1/p' || true
}

# build CMD MODULE WANT builds MODULE's cmd/CMD at WANT (or, if the proxy
# does not serve it, the newest version it serves) unless cached, and
# prints the binary's path.
build() {
  local cmd=$1 module=$2 want=$3 version src dir work
  version=$want
  # A fallback chosen before (WANT not served) is remembered.
  if [ -f "$ROOT/$cmd/resolved-$want" ] && [ -x "$ROOT/$cmd/$(cat "$ROOT/$cmd/resolved-$want")/$cmd" ]; then
    version=$(cat "$ROOT/$cmd/resolved-$want")
  fi
  if [ -x "$ROOT/$cmd/$version/$cmd" ]; then
    [ "$version" = "$want" ] || echo "$module@$want is not served; using $version (cached)" >&2
    echo "$ROOT/$cmd/$version/$cmd"
    return
  fi
  src=$(moddir "$module" "$version")
  if [ -z "$src" ]; then
    version=$(go list -m -versions "$module" | tr ' ' '\n' | grep -E '^v[0-9]+\.[0-9]+\.[0-9]+$' | sort -V | tail -n1)
    [ -n "$version" ] || { echo "the module proxy serves no $module" >&2; exit 1; }
    echo "WARNING: $module@$want (the chart's) is not served; using $version" >&2
    if [ ! -x "$ROOT/$cmd/$version/$cmd" ]; then
      src=$(moddir "$module" "$version")
      [ -n "$src" ] || { echo "cannot download $module@$version" >&2; exit 1; }
    fi
  fi
  dir=$ROOT/$cmd/$version
  mkdir -p "$dir"
  (
    exec 9>"$dir/.lock"
    flock 9
    if [ ! -x "$dir/$cmd" ]; then
      work=$(mktemp -d)
      trap 'rm -rf "$work"' EXIT
      # The module cache is read-only; build a writable copy with the
      # module's own go.mod and go.sum (its replace directives apply only
      # when it is the main module).
      cp -r "$src" "$work/src"
      chmod -R u+w "$work/src"
      echo "building $cmd $version (cold: a few minutes)" >&2
      (cd "$work/src" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath \
        -ldflags "-s -w -X main.version=$version" -o "$dir/$cmd.tmp" "./cmd/$cmd")
      mv "$dir/$cmd.tmp" "$dir/$cmd"
    fi
  ) >&2
  [ "$version" = "$want" ] || echo "$version" > "$ROOT/$cmd/resolved-$want"
  echo "$dir/$cmd"
}

want_provisioner=${PROVISIONER_VERSION:-$(chartVersion csi-provisioner)}
want_attacher=${ATTACHER_VERSION:-$(chartVersion csi-attacher)}
want_resizer=${RESIZER_VERSION:-$(chartVersion csi-resizer)}
provisioner=$(build csi-provisioner github.com/kubernetes-csi/external-provisioner/v6 "$want_provisioner")
attacher=$(build csi-attacher github.com/kubernetes-csi/external-attacher/v4 "$want_attacher")
resizer=$(build csi-resizer github.com/kubernetes-csi/external-resizer/v2 "$want_resizer")

# The set: links to the real ones (named by their versions), the
# stand-ins built from this tree.
set_dir=$ROOT/set/$(basename "$(dirname "$provisioner")")-$(basename "$(dirname "$attacher")")-$(basename "$(dirname "$resizer")")
mkdir -p "$set_dir"
for bin in "$provisioner" "$attacher" "$resizer"; do
  ln -sfn "$bin" "$set_dir/$(basename "$bin").tmp"
  mv -T "$set_dir/$(basename "$bin").tmp" "$set_dir/$(basename "$bin")"
done
for s in "${STANDINS[@]}"; do
  (cd e2e && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$set_dir/$s.tmp" "./standins/$s")
  mv "$set_dir/$s.tmp" "$set_dir/$s"
done
echo "SIDECARS=$set_dir"
