// Package iouring is the small part of Linux io_uring that the ublk
// transport needs: a ring set up with io_uring_setup (optionally with
// 128-byte submission entries, whose last 80 bytes carry a driver
// command), its submission and completion queues mapped from the kernel,
// and io_uring_enter to submit and wait. A ring is not safe for concurrent
// use: one goroutine owns it (ublk runs one ring per queue). Memory the
// kernel reads or writes after a submission returns must not be Go stack
// memory; callers use mmap'd buffers. Only Linux has it.
package iouring
