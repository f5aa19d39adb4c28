#!/usr/bin/env bash
# Makes a release under out/release (make release):
#
#   mpnbd-image-V.oci.tar       the image for linux/amd64 and linux/arm64 as one
#                               OCI index (an oci-archive: skopeo copy
#                               oci-archive:FILE docker://REGISTRY/..., or
#                               ctr images import --all-platforms)
#   mpnbd-image-V.digest        REF@sha256:... of that index
#   mpnbd-image-V.ARCH.spdx.json  the SBOM of each architecture's image (SPDX
#                               2.3: its Go modules and Debian packages)
#   mpnbd-V.tgz, mpnbd-V.tgz.prov  the chart, and its Helm provenance file
#   SHA256SUMS, SHA256SUMS.asc  every file's digest, signed (OpenPGP)
#   signing-key.asc             the public key that verifies both signatures
#
#   hack/release.sh [--version V] [--out DIR] [--key FILE] [--chart-only]
#
# V defaults to the chart's version (charts/mpnbd/Chart.yaml); the binaries,
# the image's tag, the chart's version and appVersion and mpnbd_build_info
# all say V. FILE (or $SIGNING_KEY) is an OpenPGP secret key without a
# passphrase, armoured or not (gpg --export-secret-keys); without one, a
# throwaway key is made and the release says so: verify with the key you
# trust, never with the signing-key.asc of the release itself.
# hack/verify-release.sh checks a release offline.
# --chart-only packages and signs the chart alone (the cluster suite
# installs the chart from there).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

version=$(sed -n 's/^version: *//p' charts/mpnbd/Chart.yaml)
out=$root/out/release
key=${SIGNING_KEY:-}
chart_only=false
while (($#)); do
  case $1 in
    --version) version=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --key) key=$2; shift 2 ;;
    --chart-only) chart_only=true; shift ;;
    *) echo "usage: $0 [--version V] [--out DIR] [--key FILE] [--chart-only]" >&2; exit 2 ;;
  esac
done
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] ||
  { echo "release: version $version is not semantic (X.Y.Z[-pre])" >&2; exit 2; }
HELM=$(bash hack/tools.sh | sed -n 's/^HELM=//p')
[ -x "$HELM" ] || { echo "release: no helm from hack/tools.sh" >&2; exit 1; }
command -v gpg >/dev/null || { echo "release: gpg is missing: run hack/install-deps.sh" >&2; exit 1; }

# The image's name is the chart's default: registry/repository from
# values.yaml, the version as tag.
registry=$(awk '/^image:/{i=1;next} i&&/^[^ #]/{i=0} i&&$1=="registry:"{print $2}' charts/mpnbd/values.yaml | tr -d '"')
repository=$(awk '/^image:/{i=1;next} i&&/^[^ #]/{i=0} i&&$1=="repository:"{print $2}' charts/mpnbd/values.yaml | tr -d '"')
name=${registry:+$registry/}$repository
ref=$name:$version

start=$SECONDS
mkdir -p "$out"
rm -rf "${out:?}"/*
work=$(mktemp -d)
export GNUPGHOME=$work/gnupg
mkdir -m 700 "$GNUPGHOME"
ctrs=()
cleanup() {
  for c in "${ctrs[@]}"; do buildah rm "$c" >/dev/null 2>&1 || true; done
  gpgconf --kill all >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# The signing key: given, or a throwaway one.
if [ -n "$key" ]; then
  gpg --batch --quiet --import "$key"
else
  echo "release: no --key or SIGNING_KEY: signing with a throwaway key (not for publishing)" >&2
  gpg --batch --quiet --passphrase '' --quick-gen-key "mpnbd release (throwaway) <release@mpnbd.invalid>" rsa3072 sign 1d
fi
fpr=$(gpg --batch --with-colons --list-secret-keys | awk -F: '$1=="fpr"{print $10; exit}')
uid=$(gpg --batch --with-colons --list-secret-keys | awk -F: '$1=="uid"{print $10; exit}')
[ -n "$fpr" ] || { echo "release: no secret key in ${key:-the throwaway keyring}" >&2; exit 1; }
gpg --batch --export-secret-keys "$fpr" >"$work/secring.gpg"
gpg --batch --armor --export "$fpr" >"$out/signing-key.asc"

# The chart at this version, signed (helm verify checks its .prov).
cp -r charts/mpnbd "$work/chart"
"$HELM" package "$work/chart" --version "$version" --app-version "$version" \
  --sign --key "$uid" --keyring "$work/secring.gpg" -d "$out" >/dev/null
echo "release: chart $out/mpnbd-$version.tgz" >&2

if ! $chart_only; then
  # The image, one architecture at a time, then one index of both.
  list=$ref-index
  buildah manifest rm "$list" >/dev/null 2>&1 || true
  buildah manifest create "$list" >/dev/null
  for arch in amd64 arm64; do
    bash hack/image.sh --arch "$arch" --version "$version" --tag "$ref-$arch" --no-archive
    buildah manifest add "$list" "containers-storage:$ref-$arch" >/dev/null
    # The SBOM from the image's own files.
    c=$(buildah from --pull=never "$ref-$arch")
    ctrs+=("$c")
    go run ./hack/sbom --root "$(buildah mount "$c")" --name "$name" --version "$version" --arch "$arch" \
      >"$out/mpnbd-image-$version.$arch.spdx.json"
    buildah umount "$c" >/dev/null
  done
  archive=$out/mpnbd-image-$version.oci.tar
  buildah manifest push --quiet --all --format oci "$list" "oci-archive:$archive:$ref" >&2
  buildah manifest rm "$list" >/dev/null
  # The index's digest, the one a registry shows once it is pushed.
  digest=$(tar -xOf "$archive" index.json | grep -o '"digest": *"sha256:[0-9a-f]*"' | head -1 | grep -o 'sha256:[0-9a-f]*')
  [ -n "$digest" ] || { echo "release: no digest in $archive's index.json" >&2; exit 1; }
  echo "$name:$version@$digest" >"$out/mpnbd-image-$version.digest"
  echo "release: image $name:$version@$digest" >&2
fi

(cd "$out" && sha256sum -- $(ls | grep -v -e '^SHA256SUMS' -e '^signing-key.asc$') >SHA256SUMS)
gpg --batch --quiet --armor --local-user "$fpr" --detach-sign -o "$out/SHA256SUMS.asc" "$out/SHA256SUMS"
echo "release: $version in $out, signed by $fpr ($uid), in $((SECONDS - start))s" >&2
