// Package ublk serves a Linux ublk block device (/dev/ublkbN) from
// userspace: control commands to /dev/ublk-control and, per hardware
// queue, FETCH_REQ / COMMIT_AND_FETCH_REQ on /dev/ublkcN, both as
// io_uring URING_CMD entries (pkg/iouring). A Handler does the I/O (the
// NBD session, for the ublk transport). Devices are created with user
// recovery: when the serving process dies the kernel keeps the device and
// holds its I/O, and a new process takes it over with Recover. Only Linux
// has ublk (mainline since 6.0; the kernel module is ublk_drv).
package ublk
