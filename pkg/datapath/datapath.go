// Package datapath lets the data path of a node's volumes live in a
// process other than the node plugin: the datapath component (its own
// container, updated only on demand) runs the transports (relays, FUSE
// servers, ublk queues, the NBD sessions) and serves them on a unix socket
// in the plugin's state directory; the node plugin, which a helm upgrade,
// a crash or a failed probe restarts at any time, drives them through a
// Client. A container runtime kills every process of a restarted
// container, so only a data path in another container keeps serving I/O
// across a plugin restart.
//
// The protocol is JSON-RPC over the unix socket (net/rpc/jsonrpc), one
// connection per call: a call made while the datapath itself restarts
// fails and is retried by the caller (the CSI sidecars retry).
package datapath

import (
	"context"
	"errors"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// Service is what the node plugin uses of the data path; *attach.Manager
// is the local one.
type Service interface {
	Attach(ctx context.Context, tr attach.Transport, t attach.Target, o attach.Options) (*attach.Attachment, error)
	Detach(ctx context.Context, volumeID string) error
	Health(volumeID string) (attach.Transport, attach.Health, error)
	Resize(ctx context.Context, volumeID string, newSize uint64) (uint64, error)
	Volumes() map[string]attach.Transport
	Adopt(ctx context.Context) ([]*attach.Attachment, error)
	Available() []attach.Transport
}

var _ Service = (*attach.Manager)(nil)

// The sentinel errors that cross the socket, by name: the node plugin maps
// them to gRPC codes with errors.Is.
var sentinels = map[string]error{
	"invalid":       attach.ErrInvalid,
	"not_attached":  attach.ErrNotAttached,
	"unsupported":   attach.ErrUnsupported,
	"wrong_volume":  attach.ErrWrongVolume,
	"refused":       attach.ErrServerRefused,
	"too_small":     attach.ErrTooSmall,
	"canceled":      context.Canceled,
	"deadline":      context.DeadlineExceeded,
	"datapath_gone": ErrUnavailable,
}

// ErrUnavailable: the datapath component does not answer (not running, or
// restarting).
var ErrUnavailable = errors.New("datapath: the data-path component does not answer")

// WireError is an error as it crosses the socket.
type WireError struct {
	Kind    string `json:"kind,omitempty"`
	Message string `json:"message"`
}

func toWire(err error) *WireError {
	if err == nil {
		return nil
	}
	w := &WireError{Message: err.Error()}
	for k, s := range sentinels {
		if errors.Is(err, s) {
			w.Kind = k
			break
		}
	}
	return w
}

// remoteError is an error of the datapath component, matching the
// sentinel it wrapped there.
type remoteError struct {
	sentinel error
	msg      string
}

func (e *remoteError) Error() string { return e.msg }
func (e *remoteError) Unwrap() error { return e.sentinel }

func (w *WireError) err() error {
	if w == nil {
		return nil
	}
	return &remoteError{sentinel: sentinels[w.Kind], msg: w.Message}
}

// Request and reply types of the methods (exported for net/rpc; not an
// API of their own).
type (
	AttachArgs struct {
		Transport attach.Transport
		Target    attach.Target
		Options   attach.Options
	}
	AttachReply struct {
		Attachment *attach.Attachment
		Err        *WireError
	}
	VolumeArgs  struct{ VolumeID string }
	ErrReply    struct{ Err *WireError }
	HealthReply struct {
		Transport attach.Transport
		Health    attach.Health
		Err       *WireError
	}
	ResizeArgs struct {
		VolumeID string
		NewSize  uint64
	}
	ResizeReply struct {
		Size uint64
		Err  *WireError
	}
	VolumesReply struct{ Volumes map[string]attach.Transport }
	AdoptReply   struct {
		Attachments []*attach.Attachment
		Err         *WireError
	}
	AvailableReply struct{ Transports []attach.Transport }
	None           struct{}
)
