#!/usr/bin/env bash
# Provides a Debian cloud kernel and a few of its modules for the e2e VM
# harness (e2e/vm), which boots them under qemu to test code that needs
# kernel drivers the host may lack (nbd, veth, sch_tbf, ...).
#
# Output (stdout), one KEY=VALUE a line:
#   KERNEL=<path to vmlinuz>
#   MODULE=<path to .ko>          one line per module, in load order
#                                 (dependencies first)
#   VERSION=<kernel release>      e.g. 6.1.0-57-cloud-amd64
#   PACKAGE=<package>_<version>
#
# Environment:
#   MPNBD_VM_CACHE        cache root (default /var/cache/mpnbd/vm)
#   MPNBD_VM_KERNEL_PKG   kernel package to use (default: the one the
#                         linux-image-cloud-amd64 meta-package depends on)
#   MPNBD_VM_MODULES      module names to extract (space separated)
#   MPNBD_VM_NO_INSTALL   if set, never apt-get install missing host tools
#
# With a populated cache and no network this prints the newest cached
# kernel. Safe to run concurrently (flock on the cache root).
set -euo pipefail

cache_root=${MPNBD_VM_CACHE:-/var/cache/mpnbd/vm}
modules=${MPNBD_VM_MODULES:-"nbd veth sch_tbf sch_netem loop brd"}
host_pkgs=(qemu-system-x86 e2fsprogs iproute2)
# Any busybox will do (the harness copies a dynamic one with its
# libraries), but the static one is preferred.
command -v busybox >/dev/null || host_pkgs+=(busybox-static)

log() { echo "vm-kernel: $*" >&2; }
die() { log "$*"; exit 1; }

[ "$(uname -m)" = x86_64 ] || die "only x86_64 hosts are supported"

# Host tools the harness uses: qemu to boot, busybox for the guest's
# userland, e2fsprogs and iproute2 to copy into the guest.
install_host_tools() {
	local missing=() p
	for p in "${host_pkgs[@]}"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
	done
	((${#missing[@]})) || return 0
	[ -z "${MPNBD_VM_NO_INSTALL:-}" ] || die "missing packages: ${missing[*]}"
	[ "$(id -u)" = 0 ] || die "missing packages (need root to install): ${missing[*]}"
	log "installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 ||
		{ apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; } ||
		die "apt-get install ${missing[*]} failed"
}

# resolve_pkg prints "<package> <version>" of the kernel to use, or
# nothing if apt does not know it.
resolve_pkg() {
	local pkg=${MPNBD_VM_KERNEL_PKG:-} info ver=
	if [ -z "$pkg" ]; then
		# "Depends: linux-image-6.1.0-57-cloud-amd64 (= 6.1.192-3)"
		info=$(apt-cache show --no-all-versions linux-image-cloud-amd64 2>/dev/null || true)
		pkg=$(sed -n 's/^Depends: \(linux-image-[0-9][^ ,]*\).*/\1/p' <<<"$info" | head -n1)
		[ -n "$pkg" ] || return 0
		ver=$(sed -n "s/^Depends: $pkg (= \\([^)]*\\)).*/\\1/p" <<<"$info" | head -n1)
	fi
	if [ -z "$ver" ]; then
		info=$(apt-cache show --no-all-versions "$pkg" 2>/dev/null || true)
		ver=$(sed -n 's/^Version: //p' <<<"$info" | head -n1)
	fi
	[ -z "$ver" ] || echo "$pkg $ver"
}

# module_deps prints the modules a .ko depends on (its modinfo
# "depends=" field), one a line.
module_deps() {
	tr '\0' '\n' <"$1" | sed -n 's/^depends=//p' | tr ',' '\n' | sed '/^$/d'
}

# load_order prints the paths of the requested modules in dir, each after
# the modules it depends on; it fails if one is missing.
load_order() {
	local dir=$1 m
	local -A visited=()
	visit() {
		local name=$1 d f=$dir/modules/$1.ko
		[ -z "${visited[$name]:-}" ] || return 0
		visited[$name]=1
		[ -s "$f" ] || return 1
		for d in $(module_deps "$f"); do visit "$d" || return 1; done
		echo "$f"
	}
	for m in $modules; do visit "$m" || return 1; done
}

# complete reports whether dir holds a kernel and every requested module.
complete() {
	[ -s "$1/vmlinuz" ] && [ -s "$1/release" ] && load_order "$1" >/dev/null
}

# emit prints the result for a complete cache directory.
emit() {
	local dir=$1 f
	echo "KERNEL=$dir/vmlinuz"
	for f in $(load_order "$dir"); do echo "MODULE=$f"; done
	echo "VERSION=$(cat "$dir/release")"
	echo "PACKAGE=$(basename "$dir")"
}

# populate downloads and unpacks pkg=ver into dir.
populate() {
	local pkg=$1 ver=$2 dir=$3 deb release moddir
	tmp=$(mktemp -d "$cache_root/.tmp.XXXXXX")
	deb=$(ls "$dir"/*.deb 2>/dev/null | head -n1 || true)
	if [ -z "$deb" ]; then
		log "downloading $pkg=$ver"
		local dl=(apt-get download -q -o APT::Sandbox::User=root "$pkg=$ver")
		(cd "$tmp" && "${dl[@]}" >&2) ||
			(cd "$tmp" && apt-get update -qq >&2 && "${dl[@]}" >&2) ||
			die "apt-get download $pkg=$ver failed"
		deb=$(ls "$tmp"/*.deb | head -n1)
	fi
	dpkg-deb -x "$deb" "$tmp/x"
	release=$(ls "$tmp/x/lib/modules" | head -n1)
	[ -n "$release" ] || die "no modules in $deb"
	moddir=$tmp/x/lib/modules/$release
	mkdir -p "$tmp/out/modules"
	cp "$tmp/x/boot/vmlinuz-$release" "$tmp/out/vmlinuz"
	cp "$tmp/x/boot/config-$release" "$tmp/out/config"
	echo "$release" >"$tmp/out/release"
	[ "$deb" = "$dir/$(basename "$deb")" ] || mv "$deb" "$tmp/out/"

	# Resolve dependencies depth-first so that each module follows the
	# ones it needs; decompress modules the busybox insmod cannot read.
	local -A seen=()
	add() {
		local name=$1 f d
		[ -z "${seen[$name]:-}" ] || return 0
		seen[$name]=1
		f=$(find "$moddir/kernel" \( -name "$name.ko" -o -name "$name.ko.xz" -o -name "$name.ko.zst" -o -name "$name.ko.gz" \) | head -n1)
		if [ -z "$f" ]; then
			f=$(find "$moddir/kernel" -name "${name//_/-}.ko*" | head -n1)
		fi
		[ -n "$f" ] || die "module $name not found in $pkg"
		case $f in
		*.ko) cp "$f" "$tmp/out/modules/$name.ko" ;;
		*.ko.xz) xz -dc "$f" >"$tmp/out/modules/$name.ko" ;;
		*.ko.zst) zstd -qdc "$f" >"$tmp/out/modules/$name.ko" ;;
		*.ko.gz) gzip -dc "$f" >"$tmp/out/modules/$name.ko" ;;
		esac
		for d in $(module_deps "$tmp/out/modules/$name.ko"); do add "$d"; done
	}
	local m
	for m in $modules; do add "$m"; done
	# Keep modules that an earlier run extracted for another module set.
	for m in "$dir"/modules/*.ko; do
		[ -e "$m" ] || continue
		m=${m##*/}
		add "${m%.ko}"
	done

	rm -rf "$dir.old"
	[ ! -e "$dir" ] || mv "$dir" "$dir.old"
	mv "$tmp/out" "$dir"
	rm -rf "$dir.old" "$tmp"
	# Without a pin, older kernels are no longer used; spare those touched
	# recently, which a test may be about to boot.
	if [ -z "${MPNBD_VM_KERNEL_PKG:-}" ]; then
		find "$cache_root" -mindepth 1 -maxdepth 1 -name 'linux-image-*_*' ! -path "$dir" -mmin +60 \
			-exec rm -rf {} + 2>/dev/null || true
	fi
}

mkdir -p "$cache_root" 2>/dev/null || die "cannot create $cache_root (set MPNBD_VM_CACHE)"
tmp=
trap '[ -z "$tmp" ] || rm -rf "$tmp"' EXIT
if [ -w "$cache_root" ]; then
	exec 9>>"$cache_root/.lock"
else
	exec 9<"$cache_root"
fi
flock 9

install_host_tools

read -r pkg ver < <(resolve_pkg || true) || true
if [ -z "${pkg:-}" ] && [ "$(id -u)" = 0 ] && [ -z "${MPNBD_VM_NO_INSTALL:-}" ]; then
	apt-get update -qq >&2 || true
	read -r pkg ver < <(resolve_pkg || true) || true
fi

if [ -z "${pkg:-}" ]; then
	[ -z "${MPNBD_VM_KERNEL_PKG:-}" ] || die "apt knows no package $MPNBD_VM_KERNEL_PKG"
	# apt knows no kernel (no lists, no network): use the newest cached one.
	dir=$(ls -d "$cache_root"/linux-image-*_* 2>/dev/null | sort -V | tail -n1 || true)
	[ -n "$dir" ] && complete "$dir" || die "no kernel package known to apt and none cached in $cache_root"
	emit "$dir"
	exit 0
fi

dir=$cache_root/${pkg}_${ver}
if ! complete "$dir"; then
	[ -w "$cache_root" ] || die "$cache_root is not writable"
	populate "$pkg" "$ver" "$dir"
	complete "$dir" || die "incomplete kernel cache in $dir"
fi
emit "$dir"
