// Copyright 2026 The mpnbd Authors.
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

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
//
// # Handover
//
// A planned upgrade runs the new datapath (the successor) beside the old
// one (the predecessor; the DaemonSet surges). The successor asks, on the
// handover socket next to the service socket, for every volume in turn;
// no request fails, and I/O pauses for as long as one volume takes to
// quiesce. The messages (fdpass frames: the length of the JSON, big-endian,
// then the JSON, files attached by SCM_RIGHTS):
//
//  1. successor: {op: handover, generation, liveness}. A predecessor of a
//     later generation answers {superseded} and keeps its volumes.
//  2. predecessor: {liveness} with its pidfd, if asked. From here on it
//     answers the node plugin's calls as Unavailable (retried; they reach
//     the successor once it serves).
//  3. per volume, predecessor: HandOff quiesces it (stops taking requests,
//     answers those taken, flushes what it acknowledged) and sends
//     {handoff} with the files the kernel holds the device by, or {error}
//     (the volume stays: it could not quiesce, its storage node away).
//  4. successor: TakeHandoff (without serving) and {ready: true}, or
//     {ready: false} (the predecessor resumes).
//  5. predecessor: the commit point. With {ready: true} it Releases the
//     volume for good and then sends {released}. With no readiness within
//     stepTimeout (or a broken exchange) it first sends {resumed} and then
//     serves the volume on. It never does both for one volume, and never
//     serves a volume again once it began to release it.
//  6. successor: Start only on {released}, or when the exchange ends and
//     the predecessor's pidfd shows it exited, within exitGrace, without
//     having said {resumed}: a dead process serves nothing, and one that
//     never said resumed never served the volume after its quiesce. A
//     {resumed}, or an end or silence from a predecessor still running, is
//     no release: the successor Aborts the volume and asks again later.
//     It waits for the verdict with no timeout but its context: a slow
//     predecessor (a release that flushes through an outage) is waited
//     for, never served beside.
//  7. predecessor: {done} after the last volume.
//
// What "exited" covers per transport: the relay runs in the datapath
// process itself, so its exit ends it. A FUSE volume is served by a
// process of its own, which resumes when the datapath that quiesced it
// goes away before a verdict; its successor server therefore serves only
// once that process has exited too (a pidfd of it travels with the
// handoff's files), and gives up, leaving it serving, otherwise. A ublk
// volume's process releases its device when its supervisor goes away, and
// the kernel hands the device to a new server only once no live one
// serves it (user recovery).
//
// Release never drops what the volume's session acknowledged: the relay
// and FUSE quiesce (stop taking requests, then flush) before the files
// leave; ublk, whose queues serve until the release, ends its queues at
// the release and then flushes through an outage, for as long as the
// volume's outage policy says, before it closes the session. The
// successor waits for that.
//
// The successor asks again every retryInterval while volumes stay with a
// live predecessor; once nobody answers the handover socket, what is left
// is adopted, as after a crash. A predecessor of an earlier release sends
// no pidfd: its end is then never taken for its death, and a volume whose
// release was not heard is adopted after it, as after a crash.
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

// The sentinel errors that cross the socket, by name, in the order the node
// plugin's one mapping to gRPC codes tries them (pkg/driver toStatus): an
// error wrapping several names them all, the first in this order as Kind
// for a peer that reads only that.
var sentinels = []struct {
	kind string
	err  error
}{
	{"invalid", attach.ErrInvalid},
	{"not_attached", attach.ErrNotAttached},
	{"wrong_volume", attach.ErrWrongVolume},
	{"refused", attach.ErrServerRefused},
	{"unsupported", attach.ErrUnsupported},
	{"too_small", attach.ErrTooSmall},
	{"datapath_gone", ErrUnavailable},
	{"unflushed", attach.ErrUnflushed},
	{"deadline", context.DeadlineExceeded},
	{"canceled", context.Canceled},
}

// sentinel returns the sentinel named kind, or nil.
func sentinel(kind string) error {
	for _, s := range sentinels {
		if s.kind == kind {
			return s.err
		}
	}
	return nil
}

// ErrUnavailable: the datapath component does not answer (not running, or
// restarting).
var ErrUnavailable = errors.New("datapath: the data-path component does not answer")

// WireError is an error as it crosses the socket.
type WireError struct {
	// Kind is the first sentinel the error wraps (the order of
	// sentinels); what a peer that knows no Kinds reads.
	Kind string `json:"kind,omitempty"`
	// Kinds are all the sentinels it wraps, in that order.
	Kinds   []string `json:"kinds,omitempty"`
	Message string   `json:"message"`
}

func toWire(err error) *WireError {
	if err == nil {
		return nil
	}
	w := &WireError{Message: err.Error()}
	for _, s := range sentinels {
		if errors.Is(err, s.err) {
			w.Kinds = append(w.Kinds, s.kind)
		}
	}
	if len(w.Kinds) > 0 {
		w.Kind = w.Kinds[0]
	}
	return w
}

// remoteError is an error of the datapath component, matching the
// sentinels it wrapped there.
type remoteError struct {
	sentinels []error
	msg       string
}

func (e *remoteError) Error() string   { return e.msg }
func (e *remoteError) Unwrap() []error { return e.sentinels }

func (w *WireError) err() error {
	if w == nil {
		return nil
	}
	kinds := w.Kinds
	if len(kinds) == 0 && w.Kind != "" {
		kinds = []string{w.Kind} // a peer of before Kinds
	}
	e := &remoteError{msg: w.Message}
	for _, k := range kinds {
		if s := sentinel(k); s != nil {
			e.sentinels = append(e.sentinels, s)
		}
	}
	return e
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
