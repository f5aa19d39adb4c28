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
	"errors"

	"github.com/mpnbd/mpnbd/pkg/blockdev"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// WireError carries an error between a transport and the server processes
// it starts (JSON): its text, and which of the sentinel errors callers
// test for it wraps, so that errors.Is holds on the other side.
type WireError struct {
	Message string   `json:"message"`
	Kinds   []string `json:"kinds,omitempty"`
}

// wireKinds names the sentinels a WireError keeps. The names are on the
// wire: a process of an older version may read them.
var wireKinds = []struct {
	name string
	err  error
}{
	{"invalid", ErrInvalid},
	{"not-attached", ErrNotAttached},
	{"unsupported", ErrUnsupported},
	{"wrong-volume", ErrWrongVolume},
	{"server-refused", ErrServerRefused},
	{"too-small", ErrTooSmall},
	{"unflushed", ErrUnflushed},
	{"unknown-export", nbd.ErrUnknownExport},
	{"access-denied", nbd.ErrAccessDenied},
	{"loop-busy", blockdev.ErrLoopBusy},
	{"no-free-loop", blockdev.ErrNoFreeLoop},
	{"deadline", context.DeadlineExceeded},
	{"canceled", context.Canceled},
}

// EncodeError is err as it crosses to another process; nil stays nil.
func EncodeError(err error) *WireError {
	if err == nil {
		return nil
	}
	w := &WireError{Message: err.Error()}
	for _, k := range wireKinds {
		if errors.Is(err, k.err) {
			w.Kinds = append(w.Kinds, k.name)
		}
	}
	return w
}

// remoteError is an error another process reported.
type remoteError struct {
	msg  string
	errs []error
}

func (e *remoteError) Error() string   { return e.msg }
func (e *remoteError) Unwrap() []error { return e.errs }

// Err is the error w describes, wrapping the sentinels it named; nil for
// a nil w.
func (w *WireError) Err() error {
	if w == nil {
		return nil
	}
	e := &remoteError{msg: w.Message}
	for _, name := range w.Kinds {
		for _, k := range wireKinds {
			if k.name == name {
				e.errs = append(e.errs, k.err)
			}
		}
	}
	return e
}

// IsRemote reports whether err came from another process through a
// WireError.
func IsRemote(err error) bool {
	var r *remoteError
	return errors.As(err, &r)
}
