// Command node is the CSI node plugin: the Identity and Node services of
// the driver, run on every node by a privileged DaemonSet. It attaches
// volumes with the transports the node has (the kernel's nbd driver through
// netlink, or FUSE and a loop device), formats, mounts and publishes them,
// and keeps the MPTCP subflow endpoints of the storage NICs. Run it with
// --help for the flags.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/attach/ublkdev"
)

func main() {
	// A volume's FUSE server process is this executable started again;
	// it must not do anything else first.
	if fuse.ServeRequested() {
		os.Exit(fuse.ServeMain())
	}
	// So is a ublk volume's server process.
	if ublkdev.ServeRequested() {
		os.Exit(ublkdev.ServeMain())
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
