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

package ublkdev

import (
	"context"
	"fmt"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// Attacher is the ublk transport; only Linux has ublk.
type Attacher struct{}

// New fails: only Linux has ublk.
func New(Config) (*Attacher, error) {
	return nil, fmt.Errorf("%w: ublk is Linux only", attach.ErrUnsupported)
}

func (a *Attacher) Close() {}
func (a *Attacher) Attach(context.Context, attach.Target, attach.Options) (*attach.Attachment, error) {
	return nil, attach.ErrUnsupported
}
func (a *Attacher) Detach(context.Context, string) error { return nil }
func (a *Attacher) Health(string) (attach.Health, error) {
	return attach.Health{}, attach.ErrUnsupported
}
func (a *Attacher) Resize(context.Context, string, uint64) (uint64, error) {
	return 0, attach.ErrUnsupported
}
func (a *Attacher) Adopt(context.Context) ([]*attach.Attachment, error) { return nil, nil }
func (a *Attacher) HandOff(context.Context, string) (*attach.Handoff, error) {
	return nil, attach.ErrUnsupported
}
func (a *Attacher) TakeHandoff(context.Context, *attach.Handoff) (*attach.Attachment, error) {
	return nil, attach.ErrUnsupported
}

// Supervisor is the ublk transport with a process per volume; only Linux
// has ublk.
type Supervisor struct{ Attacher }

// NewSupervisor fails: only Linux has ublk.
func NewSupervisor(Config) (*Supervisor, error) {
	return nil, fmt.Errorf("%w: ublk is Linux only", attach.ErrUnsupported)
}

// ServerPID is 0: no process serves a volume here.
func (s *Supervisor) ServerPID(string) int { return 0 }

// ServeMain fails: only Linux has ublk.
func ServeMain() int { return 2 }
