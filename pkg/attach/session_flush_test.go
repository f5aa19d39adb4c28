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
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/powerloss"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// TestHandoffFlushLeavesTheFailureToTheDevice: a handoff's own FLUSH
// (Session.Flush) hears that the storage node failed a sync: the server
// tells each connection once, so the device, whose next FLUSH is the one
// that must fail, would never hear it. Session.Flush owes it to the
// device, and with a failure owed it does not flush at all.
func TestHandoffFlushLeavesTheFailureToTheDevice(t *testing.T) {
	node := powerloss.Start(t, 1<<20)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	tg := Target{VolumeID: "v1", Export: powerloss.Export, Addrs: []string{node.Addr}}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	s, err := OpenSession(ctx, SessionConfig{Logger: log}, tg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close(time.Second) })
	if _, err := s.Client.WriteAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	node.FailNextSync()
	if err := s.Flush(5 * time.Second); err == nil {
		t.Fatal("the handoff's flush succeeded although the storage node failed the sync")
	}
	if err := s.Flush(5 * time.Second); !errors.Is(err, relay.ErrFlushFailureOwed) {
		t.Fatalf("a second handoff flush with the failure owed to the device: %v", err)
	}
	if err := s.Client.Flush(); err == nil {
		t.Fatal("the device's FLUSH succeeded: it never heard that acknowledged writes were lost")
	}
	if err := s.Client.Flush(); err != nil {
		t.Fatalf("the failure was reported to the device once; its next FLUSH: %v", err)
	}
	if err := s.Flush(5 * time.Second); err != nil {
		t.Fatalf("a handoff flush once the device heard: %v", err)
	}
}
