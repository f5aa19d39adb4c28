// Package fuse is the attach transport for nodes without an nbd driver:
// the pipelined NBD client (over MPTCP) serves the export as a single
// file in a FUSE file system, and a loop device on that file is the block
// device.
//
// For volume V the file system is mounted at <StateDir>/V and holds one
// regular file, <StateDir>/V/V, of the export's size. Reads and writes of
// the file become NBD reads and writes, fsync becomes NBD_CMD_FLUSH, and
// fallocate becomes NBD_CMD_WRITE_ZEROES (punch hole and zero range; the
// loop driver turns discards and write-zeroes requests into those). The
// loop device accesses the file with direct I/O, so neither the loop
// device's data nor the file's is cached twice.
//
// The FUSE server runs inside the attaching process: when that process
// exits, I/O to the device fails until the volume is detached and attached
// again. There is no redial either: once the connection breaks, I/O fails
// with EIO and Health reports it (Reconnects stays 0); the dead-connection
// and request timeouts of attach.Options do not apply.
package fuse

import (
	"context"
	"log/slog"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// DefaultStateDir is where volumes are mounted unless Config.StateDir says
// otherwise.
const DefaultStateDir = "/run/mpnbd/fuse"

// Defaults of the FUSE and loop settings; see Config.
const (
	// DefaultMaxWrite is the largest FUSE read or write request: 1 MiB,
	// the kernel's limit with the default fs.fuse.max_pages_limit.
	DefaultMaxWrite = 1 << 20
	// DefaultMaxBackground bounds the asynchronous requests the kernel
	// keeps in flight to the FUSE server; the loop driver's direct I/O is
	// asynchronous, so this is the device's effective queue depth. Each
	// request in flight holds a MaxWrite buffer in the server: 32 MiB at
	// most per volume. 12, 32 and 128 moved data equally fast.
	DefaultMaxBackground = 32
)

// Config configures an Attacher. Zero values mean the defaults.
type Config struct {
	// StateDir holds one mount point per attached volume
	// (DefaultStateDir if empty). It is created when missing.
	StateDir string
	// Conns is the number of NBD connections per volume (1 if zero); more
	// than one needs a server that allows multi-conn.
	Conns int
	// Dial connects to an export; nil means nbd.Dial. Tests use it to dial
	// from another network namespace.
	Dial func(ctx context.Context, o nbd.DialOptions) (*nbd.Client, error)
	// Logger receives warnings and events; nil means slog.Default().
	Logger *slog.Logger

	// MaxWrite is the largest FUSE read/write request
	// (DefaultMaxWrite if zero).
	MaxWrite int
	// MaxBackground bounds the kernel's asynchronous FUSE requests
	// (DefaultMaxBackground if zero).
	MaxBackground int

	// UnmountTimeout bounds the wait at detach for the loop device to be
	// released (by a file system unmounted just before) and for the mount
	// to let go of the file (5 s if zero).
	UnmountTimeout time.Duration

	// For measurements only: the loop device without direct I/O, the
	// FUSE file with a page cache, no asynchronous direct I/O.
	bufferedLoop, cachedFile, syncDIO bool
}

func (c Config) withDefaults() Config {
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir
	}
	if c.Conns <= 0 {
		c.Conns = 1
	}
	if c.Dial == nil {
		c.Dial = nbd.Dial
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MaxWrite <= 0 {
		c.MaxWrite = DefaultMaxWrite
	}
	if c.MaxBackground <= 0 {
		c.MaxBackground = DefaultMaxBackground
	}
	if c.UnmountTimeout <= 0 {
		c.UnmountTimeout = 5 * time.Second
	}
	return c
}
