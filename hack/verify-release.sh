#!/usr/bin/env bash
# Checks a release (hack/release.sh) offline against a public key you trust:
#
#   hack/verify-release.sh DIR KEY.asc
#
# - SHA256SUMS is signed by KEY, and every file it lists has its digest;
# - the chart's provenance file is signed by KEY and matches the chart
#   (helm verify);
# - the image archive is whole: every blob has the digest it is named by,
#   its index is the one the .digest file names, and it holds linux/amd64
#   and linux/arm64.
# Prints what it checked; exits non-zero at the first failure.
set -euo pipefail
(($# == 2)) || { echo "usage: $0 DIR KEY.asc" >&2; exit 2; }
dir=$(cd "$1" && pwd)
keyfile=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
cd "$(dirname "$0")/.."
HELM=$(bash hack/tools.sh | sed -n 's/^HELM=//p')
fail() { echo "verify: $*" >&2; exit 1; }

work=$(mktemp -d)
export GNUPGHOME=$work/gnupg
mkdir -m 700 "$GNUPGHOME"
trap 'gpgconf --kill all >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
gpg --batch --quiet --import "$keyfile" 2>/dev/null
gpg --batch --export >"$work/pubring.gpg"
[ -s "$work/pubring.gpg" ] || fail "no public key in $keyfile"

gpgv --keyring "$work/pubring.gpg" "$dir/SHA256SUMS.asc" "$dir/SHA256SUMS" 2>"$work/gpgv" ||
  { cat "$work/gpgv" >&2; fail "SHA256SUMS: bad signature"; }
echo "ok: SHA256SUMS signed by the key"
(cd "$dir" && sha256sum --quiet --strict -c SHA256SUMS) || fail "a file differs from SHA256SUMS"
listed=$(awk '{print $2}' "$dir/SHA256SUMS" | sort | tr '\n' ' ')
present=$(cd "$dir" && ls | grep -v -e '^SHA256SUMS' -e '^signing-key.asc$' | sort | tr '\n' ' ')
[ "$listed" = "$present" ] || fail "SHA256SUMS lists [$listed], the directory holds [$present]"
echo "ok: every file has its digest"

for chart in "$dir"/mpnbd-*.tgz; do
  "$HELM" verify "$chart" --keyring "$work/pubring.gpg" >/dev/null 2>"$work/helm" ||
    { cat "$work/helm" >&2; fail "$(basename "$chart"): provenance does not verify"; }
  echo "ok: $(basename "$chart") verified by its provenance file"
done

for archive in "$dir"/mpnbd-image-*.oci.tar; do
  [ -e "$archive" ] || continue # a chart-only release
  x=$work/oci
  mkdir -p "$x"
  tar -xf "$archive" -C "$x"
  for blob in "$x"/blobs/sha256/*; do
    [ "$(sha256sum <"$blob" | cut -d' ' -f1)" = "$(basename "$blob")" ] || fail "blob $(basename "$blob") does not match its digest"
  done
  index=$(grep -o '"digest": *"sha256:[0-9a-f]*"' "$x/index.json" | head -1 | grep -o '[0-9a-f]\{64\}')
  want=$(sed 's/.*@sha256://' "${archive%.oci.tar}.digest")
  [ "$index" = "$want" ] || fail "the archive's index is sha256:$index, the .digest file says sha256:$want"
  for p in amd64 arm64; do
    grep -q "\"architecture\": *\"$p\"" "$x/blobs/sha256/$index" || fail "the index has no linux/$p image"
  done
  echo "ok: $(basename "$archive") whole, index sha256:$index with linux/amd64 and linux/arm64"
  rm -rf "$x"
done
