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

package attach

import (
	"context"
	"encoding/json"
	"os"
)

// Handoff is an attached volume in transit from the process that serves
// it to a successor (a planned upgrade of the datapath component): the
// open files the kernel holds the volume's device by (the relay's end of
// the nbd socket, /dev/fuse, ...) and the transport's own state. The
// device stays, the kernel holds or queues its I/O meanwhile, and no
// request fails.
//
// The exchange has a commit point. The predecessor quiesces the volume
// (HandOff) and sends the Handoff; the successor takes it (TakeHandoff)
// without serving yet and answers that it is ready; only then does the
// predecessor Release its part for good and say so, and only on that
// word, or on the predecessor's verified exit, does the successor start
// (Handoff.Start). A predecessor that hears no readiness says it Resumes
// before it does, and the successor then Aborts: the volume never has
// two servers, and never none while both live (pkg/datapath's package
// doc has the messages). Release may take long (it flushes what the
// volume's session holds); the successor waits for it.
type Handoff struct {
	VolumeID   string
	Transport  Transport
	Target     Target
	Options    Options
	Attachment Attachment
	// State is the transport's own (JSON).
	State json.RawMessage `json:",omitempty"`
	// Files travel beside the JSON (SCM_RIGHTS), in this order.
	Files []*os.File `json:"-"`

	// Predecessor side, set by HandOff: Resume serves the volume again as
	// before; Release gives it up (the files were handed on).
	Resume  func() error `json:"-"`
	Release func()       `json:"-"`
	// Successor side, set by TakeHandoff: Start begins serving once the
	// predecessor has released the volume; Abort gives up a taken handoff
	// that will not start (the predecessor resumes).
	Start func() error `json:"-"`
	Abort func()       `json:"-"`
}

// HandingOver is a transport whose volumes can move to a successor
// process without an I/O error.
type HandingOver interface {
	// HandOff quiesces the volume's data path: it stops taking requests
	// from the kernel, completes those it took and flushes the writes it
	// acknowledged, so that nothing of the volume exists only in this
	// process. On error the volume is served as before.
	HandOff(ctx context.Context, volumeID string) (*Handoff, error)
	// TakeHandoff prepares to serve a volume handed off by a predecessor
	// (see Handoff for Start and Abort); the files become the taker's.
	TakeHandoff(ctx context.Context, h *Handoff) (*Attachment, error)
}
