// Package interop holds interoperability tests between pkg/nbd and real
// NBD implementations: libnbd's tools (nbdinfo, nbdcopy), qemu-img, fio's
// nbd engine, nbdkit and nbd-server. Each test skips, with the reason, when
// its peer is not installed.
//
// Debian packages used: libnbd-bin, qemu-utils, fio, nbdkit, nbd-server
// and mptcpize (for the Multipath TCP variants).
package interop
