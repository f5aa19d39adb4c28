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

package nbd

import (
	"context"
	"errors"
	"fmt"
	"testing"
)

// TestSupersededRefusal: a Resolve error wrapping ErrSuperseded reaches
// the client as a refusal it can tell apart (and still an access denial);
// every other refusal is not ErrSuperseded.
func TestSupersededRefusal(t *testing.T) {
	s := newTestServer(t, &Export{Name: "vol", Backend: NewMemBackend(1 << 20)})
	s.Resolve = func(_ ConnInfo, name string) (Grant, error) {
		switch name {
		case "old":
			return Grant{}, fmt.Errorf("epoch 3, the publication's 5: %w", ErrSuperseded)
		case "unknown":
			return Grant{}, fmt.Errorf("not here yet: %w", ErrUnknownExport)
		}
		return Grant{}, errors.New("not published")
	}
	for _, tc := range []struct {
		name             string
		superseded, deny bool
	}{
		{"old", true, true},
		{"other", false, true},
		{"unknown", false, false},
	} {
		_, err := NegotiateConn(context.Background(), pipeConn(t, s), tc.name)
		if err == nil {
			t.Fatalf("%s: opened", tc.name)
		}
		if errors.Is(err, ErrSuperseded) != tc.superseded || errors.Is(err, ErrAccessDenied) != tc.deny {
			t.Errorf("%s: %v: superseded %t, access denied %t; want %t, %t", tc.name, err,
				errors.Is(err, ErrSuperseded), errors.Is(err, ErrAccessDenied), tc.superseded, tc.deny)
		}
	}
}
