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

//go:build !linux

package fuse

import (
	"context"
	"fmt"
	"os"
	"runtime"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// Attacher is the FUSE transport; it only works on Linux.
type Attacher struct{ cfg Config }

var _ attach.Attacher = (*Attacher)(nil)

// New returns an Attacher whose every call fails with ErrUnsupported.
func New(c Config) *Attacher { return &Attacher{cfg: c.withDefaults()} }

func unsupported() error {
	return fmt.Errorf("%w: fuse transport (GOOS=%s)", attach.ErrUnsupported, runtime.GOOS)
}

// Available tells whether this node can use the transport: never here.
func Available() error { return unsupported() }

// Attach is only implemented on Linux.
func (a *Attacher) Attach(ctx context.Context, t attach.Target, o attach.Options) (*attach.Attachment, error) {
	return nil, unsupported()
}

// Detach of a volume that cannot have been attached succeeds.
func (a *Attacher) Detach(ctx context.Context, volumeID string) error { return nil }

// Health is only implemented on Linux.
func (a *Attacher) Health(volumeID string) (attach.Health, error) {
	return attach.Health{}, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
}

// Resize is only implemented on Linux.
func (a *Attacher) Resize(ctx context.Context, volumeID string, newSize uint64) (uint64, error) {
	return 0, unsupported()
}

// Adopt finds nothing here.
func (a *Attacher) Adopt(ctx context.Context) ([]*attach.Attachment, error) { return nil, nil }

// ServeMain is only implemented on Linux: it reports that and returns 2.
func ServeMain() int {
	fmt.Fprintln(os.Stderr, unsupported())
	return 2
}

// HandOff is only implemented on Linux.
func (a *Attacher) HandOff(ctx context.Context, volumeID string) (*attach.Handoff, error) {
	return nil, unsupported()
}

// TakeHandoff is only implemented on Linux.
func (a *Attacher) TakeHandoff(ctx context.Context, h *attach.Handoff) (*attach.Attachment, error) {
	return nil, unsupported()
}
