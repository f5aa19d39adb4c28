#!/usr/bin/env bash
# Builds the driver's image from the Dockerfile with buildah (no daemon, no
# registry) and writes it as a docker-archive tar, which `docker load` and
# `ctr images import` take. Prints IMAGE_TAR=<tar>.
#
#   hack/image.sh [--tag REF] [--version VERSION] [--arch ARCH] [--out TAR|--no-archive]
#   hack/image.sh --base-only [--arch ARCH]   only make sure the base images exist
#
# ARCH is amd64 (this machine's, the default) or arm64. Another
# architecture's image is built with Go cross-compiling on this machine and
# the runtime stage's few commands emulated (qemu-user-static, hack/binfmt.sh).
#
# The Dockerfile's base images are made here, under the names its FROM
# lines use, and kept in buildah's storage (/var/lib/containers):
#   debian:bookworm-slim       Debian bookworm from debootstrap (minbase),
#                              no extra packages: the Dockerfile installs
#                              what the driver needs itself
#   localhost/debian:bookworm-slim-ARCH
#                              the same for another ARCH, given to the
#                              Dockerfile as BASE_IMAGE
#   golang:<go>-bookworm       that, ca-certificates, and this machine's Go
#                              toolchain at /usr/local/go with the official
#                              image's GOPATH, PATH and GOTOOLCHAIN (not its
#                              gcc or git: the build needs neither)
# They are made when missing, and golang again when this machine's Go
# changes (cold: ~2 minutes). The build runs with --pull=never, so the names
# resolve to these images, never to a registry. Its RUN steps share this
# machine's Go module and build caches (bind mounts, not part of the
# image), and --layers keeps the apt-get and `go mod download` steps
# cached between builds.
set -euo pipefail
cd "$(dirname "$0")/.."

# The chart's version names the image the chart installs by default.
version=$(sed -n 's/^version: *//p' charts/mpnbd/Chart.yaml)
tag=
out=$PWD/out/mpnbd-image.tar
base_only=false
host_arch=$(go env GOHOSTARCH)
arch=$host_arch
while (($#)); do
  case $1 in
    --tag) tag=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-archive) out=; shift ;;
    --arch) arch=$2; shift 2 ;;
    --base-only) base_only=true; shift ;;
    *) echo "usage: $0 [--tag REF] [--version VERSION] [--arch ARCH] [--out TAR|--no-archive] | --base-only [--arch ARCH]" >&2; exit 2 ;;
  esac
done

tag=${tag:-ghcr.io/mpnbd/mpnbd:$version}
command -v buildah >/dev/null || { echo "buildah is missing: run hack/install-deps.sh" >&2; exit 1; }
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SLIM=docker.io/library/debian:bookworm-slim
case $arch in
  "$host_arch") BASE=$SLIM ;;
  amd64 | arm64)
    BASE=localhost/debian:bookworm-slim-$arch
    bash "$(dirname "$0")/binfmt.sh" "$arch"
    ;;
  *) echo "hack/image.sh: architecture $arch: amd64 or arm64" >&2; exit 2 ;;
esac
go_full=$(go env GOVERSION)                          # go1.26.8
go_minor=$(echo "${go_full#go}" | cut -d. -f1,2)     # 1.26
GOLANG=docker.io/library/golang:$go_minor-bookworm
GO_LABEL=io.mpnbd.base.go-version
PATH_ENV=/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

have() { buildah inspect --type image "$1" >/dev/null 2>&1; }

# Only one maker of the base images at a time.
LOCKDIR=/var/cache/mpnbd
mkdir -p "$LOCKDIR"
exec 9>"$LOCKDIR/.image-base.lock"
flock 9

ctr=
cleanup() { [ -z "$ctr" ] || buildah rm "$ctr" >/dev/null 2>&1 || true; }
trap cleanup EXIT

# make_slim NAME ARCH makes Debian bookworm minbase for ARCH under NAME. A
# foreign ARCH's second stage runs its programs under qemu-user-static
# through binfmt_misc (hack/binfmt.sh).
make_slim() {
  local name=$1 arch=$2 root log start
  echo "making $name: debootstrap bookworm minbase for $arch (cold: a minute or two; ~3 when emulated)" >&2
  start=$SECONDS
  ctr=$(buildah from --pull=never scratch)
  root=$(buildah mount "$ctr")
  log=$(mktemp)
  debootstrap --arch="$arch" --variant=minbase bookworm "$root" "$MIRROR" >"$log" 2>&1 || {
    tail -20 "$log" >&2
    exit 1
  }
  rm -f "$log"
  # The same sources as Debian's own image, then what an image leaves out.
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* \
    "$root"/var/log/* "$root"/dev/* "$root"/run/* "$root"/tmp/*
  : >"$root/etc/hostname"
  # Slim, as Debian's slim image is: no manuals, documentation (but the
  # copyright files) or translations, now or from later installs.
  cat >"$root/etc/dpkg/dpkg.cfg.d/slim" <<EOF
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/info/*
path-exclude /usr/share/man/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$root"/usr/share/info/* "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/usr/share/lintian/*
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd bash \
    --os linux --arch "$arch" "$ctr"
  buildah commit --quiet --rm "$ctr" "$name" >/dev/null
  ctr=
  echo "made $name in $((SECONDS - start))s" >&2
}

have "$SLIM" || make_slim "$SLIM" "$host_arch"
have "$BASE" || make_slim "$BASE" "$arch"

made_go=$(buildah inspect --type image --format "{{index .OCIv1.Config.Labels \"$GO_LABEL\"}}" "$GOLANG" 2>/dev/null || true)
if [ "$made_go" != "$go_full" ]; then
  echo "making $GOLANG from $SLIM and $(go env GOROOT) ($go_full)" >&2
  start=$SECONDS
  ctr=$(buildah from --pull=never "$SLIM")
  buildah run --network=host "$ctr" -- sh -ec \
    'apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ca-certificates netbase >/dev/null; rm -rf /var/lib/apt/lists/*'
  buildah copy --quiet "$ctr" "$(go env GOROOT)" /usr/local/go >/dev/null
  buildah run "$ctr" -- sh -ec 'mkdir -p /go/src /go/bin; chmod -R 1777 /go'
  buildah config --env GOLANG_VERSION="${go_full#go}" --env GOTOOLCHAIN=local --env GOPATH=/go \
    --env PATH="$PATH_ENV" --workingdir /go --label "$GO_LABEL=$go_full" "$ctr"
  buildah commit --quiet --rm "$ctr" "$GOLANG" >/dev/null
  ctr=
  echo "made $GOLANG in $((SECONDS - start))s" >&2
fi
flock -u 9

if $base_only; then
  exit 0
fi

start=$SECONDS
[ -z "$out" ] || mkdir -p "$(dirname "$out")"
before=$(buildah images --all --quiet --no-trunc)
gomodcache=$(go env GOMODCACHE) gocache=$(go env GOCACHE)
mkdir -p "$gomodcache" "$gocache"
buildah build --pull=never --layers --network=host \
  -v "$gomodcache":/go/pkg/mod -v "$gocache":/root/.cache/go-build \
  --platform "linux/$arch" --build-arg BUILDPLATFORM="linux/$host_arch" --build-arg BASE_IMAGE="$BASE" \
  --build-arg GO_VERSION="$go_minor" --build-arg VERSION="$version" \
  -t "$tag" -f Dockerfile . >&2
if [ -n "$out" ]; then
  rm -f "$out"
  buildah push --quiet "$tag" "docker-archive:$out:$tag" >&2
fi
# What earlier builds left and this one does not use goes: images from
# before this build that nothing is based on and no name points at (the
# tag's previous image, then its layers' images, one generation a pass).
while :; do
  gone=0
  for id in $(buildah images --all --quiet --no-trunc --filter dangling=true); do
    if grep -qx "$id" <<<"$before" && buildah rmi "$id" >/dev/null 2>&1; then
      gone=1
    fi
  done
  ((gone)) || break
done
echo "built $tag (VERSION=$version, linux/$arch) in $((SECONDS - start))s" >&2
[ -z "$out" ] || echo "IMAGE_TAR=$out"
