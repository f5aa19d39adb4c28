#!/usr/bin/env bash
# Builds the CSI sidecars the cluster suite runs beside our plugin:
#  - the real external-provisioner, external-attacher, external-resizer and
#    external-snapshotter (cmd/csi-provisioner, cmd/csi-attacher,
#    cmd/csi-resizer, cmd/csi-snapshotter) from the Go module proxy, each
#    with its own go.mod (never the driver's), at the version
#    charts/mpnbd/values.yaml runs (PROVISIONER_VERSION, ATTACHER_VERSION,
#    RESIZER_VERSION, SNAPSHOTTER_VERSION override it); a version the proxy
#    does not serve falls back, with a warning, to the newest it serves;
#  - the snapshot-controller of the snapshotter's release, with that
#    release's snapshot CRDs and the controller's RBAC (in
#    snapshot-manifests/): the cluster suite installs them as a cluster
#    admin would;
#  - our stand-ins of csi-node-driver-registrar and livenessprobe
#    (e2e/standins/, in the e2e module), which take the chart's flags (the module proxy serves
#    no real ones).
# All static. The real ones are built once into
# ${MPNBD_SIDECAR_CACHE:-/var/cache/mpnbd/sidecars}/<command>/<version>/
# (cold: a few minutes each); the stand-ins are rebuilt from this tree on
# every run (the Go build cache makes that quick). Prints SIDECARS=<dir>,
# a directory holding the seven commands and snapshot-manifests/.
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
      # A module that keeps a part in a module of its own beside it
      # (external-snapshotter's client) replaces it with a directory the
      # proxy's zip leaves out: fetch that module at the same version.
      sed -n 's|^replace \([^ ]*\) => \(\./[^ ]*\)$|\1 \2|p' "$work/src/go.mod" | while read -r mod rel; do
        [ -e "$work/src/$rel/go.mod" ] && continue
        local_src=$(moddir "$mod" "$version")
        [ -n "$local_src" ] || { echo "cannot download $mod@$version (replaced by $rel)" >&2; exit 1; }
        rm -rf "${work:?}/src/$rel"
        cp -r "$local_src" "$work/src/$rel"
        chmod -R u+w "$work/src/$rel"
      done
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
want_snapshotter=${SNAPSHOTTER_VERSION:-$(chartVersion csi-snapshotter)}
provisioner=$(build csi-provisioner github.com/kubernetes-csi/external-provisioner/v6 "$want_provisioner")
attacher=$(build csi-attacher github.com/kubernetes-csi/external-attacher/v4 "$want_attacher")
resizer=$(build csi-resizer github.com/kubernetes-csi/external-resizer/v2 "$want_resizer")
snapshotter=$(build csi-snapshotter github.com/kubernetes-csi/external-snapshotter/v8 "$want_snapshotter")
# The snapshot-controller a cluster runs once for every driver, at the
# snapshotter's version: the chart does not install it, the cluster suite
# does, with its CRDs and RBAC (below).
snapshot_controller=$(build snapshot-controller github.com/kubernetes-csi/external-snapshotter/v8 "$(basename "$(dirname "$snapshotter")")")

# The set: links to the real ones (named by their versions), the
# stand-ins built from this tree.
set_dir=$ROOT/set/$(basename "$(dirname "$provisioner")")-$(basename "$(dirname "$attacher")")-$(basename "$(dirname "$resizer")")-$(basename "$(dirname "$snapshotter")")
mkdir -p "$set_dir"
# One run at a time assembles a set: two at once wrote the same temporary
# files and one emptied snapshot-manifests/ while the other filled it.
exec 8>"$set_dir/.lock"
flock 8
for bin in "$provisioner" "$attacher" "$resizer" "$snapshotter" "$snapshot_controller"; do
  ln -sfn "$bin" "$set_dir/$(basename "$bin").tmp"
  mv -T "$set_dir/$(basename "$bin").tmp" "$set_dir/$(basename "$bin")"
done
for s in "${STANDINS[@]}"; do
  (cd e2e && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$set_dir/$s.tmp" "./standins/$s")
  mv "$set_dir/$s.tmp" "$set_dir/$s"
done
# The snapshot API's CRDs and the snapshot-controller's RBAC, as that
# release ships them.
snap_version=$(basename "$(dirname "$snapshotter")")
crd_src=$(moddir github.com/kubernetes-csi/external-snapshotter/client/v8 "$snap_version")
ctl_src=$(moddir github.com/kubernetes-csi/external-snapshotter/v8 "$snap_version")
[ -n "$crd_src" ] && [ -n "$ctl_src" ] || { echo "cannot download external-snapshotter $snap_version's manifests" >&2; exit 1; }
rm -rf "$set_dir/snapshot-manifests"
mkdir -p "$set_dir/snapshot-manifests"
cp "$crd_src"/config/crd/snapshot.storage.k8s.io_*.yaml "$set_dir/snapshot-manifests/"
cp "$ctl_src/deploy/kubernetes/snapshot-controller/rbac-snapshot-controller.yaml" "$set_dir/snapshot-manifests/"
chmod -R u+w "$set_dir/snapshot-manifests"
echo "SIDECARS=$set_dir"
