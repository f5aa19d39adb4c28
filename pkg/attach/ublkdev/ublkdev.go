// Package ublkdev attaches exports as /dev/ublkbN: the ublk transport. The
// device's I/O is served in this process, through the volume's NBD session
// (attach.Session: every storage address in turn, redial, replay,
// retention), over MPTCP end to end with no relay hop and no loop device.
// Devices are made with ublk's user recovery: when this process dies the
// kernel keeps the device and holds its I/O, and the next process takes
// it over (Adopt) from the state directory, continuing the volume's
// session, so a node plugin restart costs a pause, not an error.
package ublkdev

import (
	"context"
	"log/slog"
	"net"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Config configures an Attacher.
type Config struct {
	// StateDir keeps one file per attached volume, for Adopt.
	StateDir string
	// DialContext makes the volume's connections; nil means d.DialContext.
	DialContext func(ctx context.Context, d *net.Dialer, network, addr string) (net.Conn, error)
	// Queues and Depth of each device (zero: one queue per CPU up to 4,
	// 64 requests each).
	Queues, Depth int
	Logger        *slog.Logger
}

// record is what a state file keeps about an attached volume.
type record struct {
	Target  attach.Target  `json:"target"`
	Options attach.Options `json:"options"`
	DevID   uint32         `json:"dev_id"`
	Session nbd.SessionID  `json:"session"`
}
