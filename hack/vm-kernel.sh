#!/usr/bin/env bash
# Provides a Debian cloud kernel and a few of its modules for the e2e VM
# harness (internal/testenv/vm), which boots them under qemu to test code that needs
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
#                         meta-package below depends on)
#   MPNBD_VM_KERNEL_META  that meta-package (default linux-image-cloud-amd64)
#   MPNBD_VM_KERNEL_SUITE take the kernel from this suite of the Debian
#                         archive (e.g. trixie-backports) with apt lists of
#                         its own in the cache, instead of the host's sources
#   MPNBD_VM_MODULES      module names to extract (space separated)
#   MPNBD_VM_NO_INSTALL   if set, never apt-get install missing host tools
#
# With a populated cache and no network this prints the newest cached
# kernel. Safe to run concurrently (flock on the cache root).
set -euo pipefail

cache_root=${MPNBD_VM_CACHE:-/var/cache/mpnbd/vm}
meta=${MPNBD_VM_KERNEL_META:-linux-image-cloud-amd64}
suite=${MPNBD_VM_KERNEL_SUITE:-}
# apt as this run uses it: the host's sources, or the suite's own lists.
apt_opts=()
if [ -n "$suite" ]; then
	apt_dir=$cache_root/apt-$suite
	apt_opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o Dir::Etc::sourceparts=-
		-o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache")
fi
modules=${MPNBD_VM_MODULES:-"nbd veth sch_tbf sch_netem loop brd nf_tables"}
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
		info=$(apt-cache "${apt_opts[@]}" show --no-all-versions "$meta" 2>/dev/null || true)
		# (or with other packages first, as in newer meta-packages).
		pkg=$(sed -n 's/^Depends: .*\b\(linux-image-[0-9][^ ,]*\).*/\1/p' <<<"$info" | head -n1)
		[ -n "$pkg" ] || return 0
		ver=$(sed -n "s/^Depends: .*\\b$pkg (= \\([^)]*\\)).*/\\1/p" <<<"$info" | head -n1)
	fi
	if [ -z "$ver" ]; then
		info=$(apt-cache "${apt_opts[@]}" show --no-all-versions "$pkg" 2>/dev/null || true)
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

# download fetches pkg=ver into $tmp.
download() {
	log "downloading $1=$2"
	local dl=(apt-get "${apt_opts[@]}" download -q -o APT::Sandbox::User=root "$1=$2")
	(cd "$tmp" && "${dl[@]}" >&2) ||
		(cd "$tmp" && apt_update && "${dl[@]}" >&2) ||
		die "apt-get download $1=$2 failed"
}

# populate downloads and unpacks pkg=ver into dir.
populate() {
	local pkg=$1 ver=$2 dir=$3 deb release moddir part
	tmp=$(mktemp -d "$cache_root/.tmp.XXXXXX")
	local debs=()
	for deb in "$dir"/*.deb; do [ -e "$deb" ] && debs+=("$deb"); done
	if ((${#debs[@]} == 0)); then
		download "$pkg" "$ver"
		# Newer kernels come in parts (image, modules, base files): the
		# image package is then only their dependency.
		for part in $(apt-cache "${apt_opts[@]}" show --no-all-versions "$pkg=$ver" 2>/dev/null |
			sed -n 's/^Depends: //p' | tr ',' '\n' | sed -n 's/^ *\(linux-\(binary\|modules\|base\)-[^ ]*\) (= .*/\1/p'); do
			download "$part" "$ver"
		done
		for deb in "$tmp"/*.deb; do debs+=("$deb"); done
	fi
	for deb in "${debs[@]}"; do dpkg-deb -x "$deb" "$tmp/x"; done
	# /lib/modules, or /usr/lib/modules where /usr is merged.
	local mods=$tmp/x/lib/modules
	[ -d "$mods" ] || mods=$tmp/x/usr/lib/modules
	release=$(ls "$mods" 2>/dev/null | head -n1 || true)
	[ -n "$release" ] || die "no modules in ${debs[*]}"
	moddir=$mods/$release
	mkdir -p "$tmp/out/modules"
	# The image and its config: in /boot, or (newer packages) beside the
	# modules.
	if [ -e "$tmp/x/boot/vmlinuz-$release" ]; then
		cp "$tmp/x/boot/vmlinuz-$release" "$tmp/out/vmlinuz"
		cp "$tmp/x/boot/config-$release" "$tmp/out/config"
	else
		cp "$moddir/vmlinuz" "$tmp/out/vmlinuz"
		cp "$moddir/config" "$tmp/out/config"
	fi
	echo "$release" >"$tmp/out/release"
	echo "${suite:-host}" >"$tmp/out/suite"
	for deb in "${debs[@]}"; do
		[ "$deb" = "$dir/$(basename "$deb")" ] || mv "$deb" "$tmp/out/"
	done

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
	# Without a pin, older kernels of the same source are no longer used;
	# spare those touched recently, which a test may be about to boot.
	if [ -z "${MPNBD_VM_KERNEL_PKG:-}" ]; then
		local old
		for old in $(find "$cache_root" -mindepth 1 -maxdepth 1 -name 'linux-image-*_*' ! -path "$dir" -mmin +60); do
			[ "$(suite_of "$old")" = "${suite:-host}" ] && rm -rf "$old"
		done
	fi
}

# suite_of prints where a cached kernel came from ("host": the host's
# sources; a cache entry from before this was recorded counts as such).
suite_of() { cat "$1/suite" 2>/dev/null || echo host; }

# newest_cached prints the newest complete cached kernel of this run's
# source, or nothing.
newest_cached() {
	local d
	for d in $(ls -d "$cache_root"/linux-image-*_* 2>/dev/null | sort -rV); do
		[ "$(suite_of "$d")" = "${suite:-host}" ] && complete "$d" && { echo "$d"; return; }
	done
}

# apt_update refreshes the lists apt uses here: the suite's own ones are
# made on first use.
apt_update() {
	if [ -n "$suite" ]; then
		mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
		echo "deb http://deb.debian.org/debian $suite main" >"$apt_dir/sources.list"
	fi
	apt-get "${apt_opts[@]}" update -qq >&2
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
	apt_update || true
	read -r pkg ver < <(resolve_pkg || true) || true
fi

if [ -z "${pkg:-}" ]; then
	[ -z "${MPNBD_VM_KERNEL_PKG:-}" ] || die "apt knows no package $MPNBD_VM_KERNEL_PKG${suite:+ in $suite}"
	# apt knows no kernel (no lists, no network): use the newest cached one.
	dir=$(newest_cached)
	[ -n "$dir" ] || die "no kernel package known to apt${suite:+ in $suite} and none cached in $cache_root"
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
