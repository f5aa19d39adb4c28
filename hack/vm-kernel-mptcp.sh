#!/usr/bin/env bash
# Builds a guest kernel for the e2e VM harness (internal/testenv/vm) whose nbd driver
# accepts MPTCP sockets, so that the `kernel` transport can be tested for
# real. Stock kernels refuse them: nbd_get_socket() accepts only TCP and
# stream UNIX sockets (see docs/KERNEL-FACTS.md, "The socket-type
# restriction"). The source is Debian's linux-source-6.1 package; the one
# change, made below, adds a third accepted socket kind to that check:
# sk_type SOCK_STREAM with sk_protocol IPPROTO_MPTCP.
#
# The kernel has no loadable modules: everything the harness needs (nbd,
# veth, sch_tbf, sch_netem, loop, brd, fuse, ext4, xfs) is built in.
#
# Output (stdout): VM_KERNEL_MPTCP=<path to bzImage>
#
# The image is cached in $MPNBD_VM_CACHE/mptcp-<sha>/bzImage, where sha
# covers the source package version, the configuration and the change;
# a warm run only prints the path. A cold build takes ~20 minutes on two
# cores (at nice 19).
#
# Environment:
#   MPNBD_VM_CACHE        cache root (default /var/cache/mpnbd/vm)
#   MPNBD_VM_NO_INSTALL   if set, never apt-get install missing packages
#   MPNBD_VM_NO_BUILD     if set, only look up the cache (exit 3 if cold)
#   MPNBD_VM_JOBS         make -j (default: nproc)
set -euo pipefail

cache_root=${MPNBD_VM_CACHE:-/var/cache/mpnbd/vm}
src_pkg=linux-source-6.1
src_tar=/usr/src/linux-source-6.1.tar.xz
build_pkgs=("$src_pkg" flex bison libelf-dev bc libssl-dev make gcc libc6-dev perl xz-utils)

log() { echo "vm-kernel-mptcp: $*" >&2; }
die() {
	log "$*"
	exit 1
}

[ "$(uname -m)" = x86_64 ] || die "only x86_64 hosts are supported"

# Options set on top of `make defconfig kvm_guest.config`. y = built in,
# n = off, anything else is a value.
config_opts='
MODULES=n
DEBUG_INFO=n
DEBUG_INFO_NONE=y
DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT=n
DEBUG_INFO_DWARF4=n
DEBUG_INFO_DWARF5=n
DEBUG_INFO_BTF=n
BLK_DEV_NBD=y
MPTCP=y
MPTCP_IPV6=y
INET_MPTCP_DIAG=y
INET_DIAG=y
VETH=y
NET_NS=y
NET_SCHED=y
NET_SCH_TBF=y
NET_SCH_NETEM=y
NET_SCH_HTB=y
EXT4_FS=y
XFS_FS=y
BLK_DEV_INITRD=y
RD_GZIP=y
DEVTMPFS=y
DEVTMPFS_MOUNT=y
FUSE_FS=y
BLK_DEV_LOOP=y
BLK_DEV_RAM=y
BLK_DEV_RAM_COUNT=1
BLK_DEV_RAM_SIZE=131072
IO_URING=y
BLK_DEV_UBLK=y
'

# The change to drivers/block/nbd.c, as a perl program run with -0777 -pi
# (whole file in $_). It fails when the expected check is not there, so a
# new source version that reshapes nbd_get_socket() stops the build.
nbd_change='
my $n = s{(\n[ \t]*if \(!sk_is_tcp\(sock->sk\) &&\n[ \t]*)(!sk_is_stream_unix\(sock->sk\)\) \{)}{$1!(sock->sk->sk_type == SOCK_STREAM &&\n\t      sock->sk->sk_protocol == IPPROTO_MPTCP) &&\n\t    $2};
$n == 1 or die "nbd_get_socket: socket check not found (matched ${\($n || 0)} times)\n";
s{"Unsupported socket: should be TCP or UNIX\.\\n"}{"Unsupported socket: should be TCP, MPTCP or UNIX.\\n"} or
	die "nbd_get_socket: error message not found\n";
'

install_build_deps() {
	local missing=() p
	for p in "${build_pkgs[@]}"; do
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

# cache_key prints the sha256 of everything that shapes the image.
cache_key() {
	local ver
	ver=$(dpkg-query -W -f='${Version}' "$src_pkg")
	printf '%s\n%s\n%s\n%s\n' "$src_pkg=$ver" "$config_opts" "$nbd_change" "defconfig kvm_guest.config" |
		sha256sum | cut -c1-16
}

# configure applies config_opts to .config in the current directory.
configure() {
	local line key val args=()
	while read -r line; do
		[ -n "$line" ] || continue
		key=${line%%=*}
		val=${line#*=}
		case $val in
		y) args+=(--enable "$key") ;;
		n) args+=(--disable "$key") ;;
		*) args+=(--set-val "$key" "$val") ;;
		esac
	done <<<"$config_opts"
	scripts/config "${args[@]}"
}

# check_config fails unless every y/value option survived olddefconfig
# (a dependency we did not enable would drop it silently).
check_config() {
	local line key val bad=()
	while read -r line; do
		[ -n "$line" ] || continue
		key=${line%%=*}
		val=${line#*=}
		case $val in
		n) grep -q "^CONFIG_$key=[ym]" .config && bad+=("$key still set") ;;
		*) grep -qx "CONFIG_$key=$val" .config || bad+=("$key!=$val") ;;
		esac
	done <<<"$config_opts"
	((${#bad[@]} == 0)) || die "configuration did not take: ${bad[*]}"
}

build() {
	local out=$1 jobs=${MPNBD_VM_JOBS:-$(nproc)} start=$SECONDS
	tmp=$(mktemp -d "$cache_root/.build-mptcp.XXXXXX")
	log "unpacking $src_tar"
	tar -xJf "$src_tar" -C "$tmp"
	local src
	src=$(find "$tmp" -mindepth 1 -maxdepth 1 -type d | head -n1)
	[ -f "$src/drivers/block/nbd.c" ] || die "no drivers/block/nbd.c in $src_tar"
	(
		cd "$src"
		perl -0777 -pi -e "$nbd_change" drivers/block/nbd.c
		grep -q 'IPPROTO_MPTCP' drivers/block/nbd.c || die "change not applied"
		log "configuring"
		make -s defconfig kvm_guest.config >&2
		configure
		make -s olddefconfig >&2
		check_config
		log "building bzImage with -j$jobs (about 20 minutes on two cores)"
		nice -n 19 make -s -j"$jobs" bzImage >&2 || die "make bzImage failed"
	)
	mkdir -p "$tmp/out"
	cp "$src/arch/x86/boot/bzImage" "$tmp/out/bzImage"
	cp "$src/.config" "$tmp/out/config"
	make -s -C "$src" kernelrelease >"$tmp/out/release"
	dpkg-query -W -f='${Package}_${Version}\n' "$src_pkg" >"$tmp/out/source"
	echo "$((SECONDS - start))" >"$tmp/out/build-seconds"
	rm -rf "$out"
	mv "$tmp/out" "$out"
	rm -rf "$tmp"
	tmp=
	log "built $out/bzImage in $((SECONDS - start)) s"
}

mkdir -p "$cache_root" 2>/dev/null || die "cannot create $cache_root (set MPNBD_VM_CACHE)"
tmp=
trap '[ -z "$tmp" ] || rm -rf "$tmp"' EXIT

if [ -n "${MPNBD_VM_NO_BUILD:-}" ]; then
	# Look-up only (the VM tests): install nothing, build nothing.
	dpkg-query -W -f='${Status}' "$src_pkg" 2>/dev/null | grep -q 'install ok installed' || {
		log "not built: package $src_pkg is not installed (run hack/vm-kernel-mptcp.sh)"
		exit 3
	}
else
	install_build_deps
	[ -s "$src_tar" ] || die "$src_tar is missing (package $src_pkg)"
fi

dir=$cache_root/mptcp-$(cache_key)
if [ ! -s "$dir/bzImage" ]; then
	[ -z "${MPNBD_VM_NO_BUILD:-}" ] || {
		log "not built: no $dir/bzImage (run hack/vm-kernel-mptcp.sh, ~20 minutes cold)"
		exit 3
	}
	[ -w "$cache_root" ] || die "$cache_root is not writable"
	# Own lock: the stock kernel script keeps working during a build.
	exec 9>>"$cache_root/.lock-mptcp"
	flock 9
	[ -s "$dir/bzImage" ] || build "$dir"
fi
echo "VM_KERNEL_MPTCP=$dir/bzImage"
