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

package fuse

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/powerloss"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

// TestDetachWithTheStorageNodeAwayFails: the last step of a detach, once
// the loop device and the mount are gone, makes what the session retains
// durable; with the storage node away (it lost power, its cache with it)
// it fails, keeping the session, and the next try, once the node is back,
// flushes and succeeds.
func TestDetachWithTheStorageNodeAwayFails(t *testing.T) {
	node := powerloss.Start(t, 1<<20)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	tg := attach.Target{VolumeID: "v1", Export: powerloss.Export, Addrs: []string{node.Addr}}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	sess, err := attach.OpenSession(ctx, attach.SessionConfig{Logger: log}, tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// A volume whose loop device and mount are gone already.
	v := &volume{target: tg, dir: filepath.Join(t.TempDir(), "mnt"), path: sess, node: &exportFile{bio: sess.Client, log: log}}
	t.Cleanup(func() {
		if !v.closed {
			sess.Close(time.Second)
		}
	})
	data := bytes.Repeat([]byte("written, never fsync'ed "), 4096/24+1)[:4096]
	if _, err := sess.Client.WriteAt(data, 12288); err != nil {
		t.Fatal(err)
	}
	node.PowerLoss()
	if err := teardown(v, 300*time.Millisecond, log); !errors.Is(err, attach.ErrUnflushed) {
		t.Fatalf("a detach with an unflushed write and the storage node away: %v, want ErrUnflushed", err)
	}
	if v.closed {
		t.Fatal("the failed detach closed the session and the write it retains")
	}
	node.Restore()
	if err := teardown(v, 20*time.Second, log); err != nil {
		t.Fatalf("the detach once the storage node is back: %v", err)
	}
	if got := node.Durable(12288, 4096); !bytes.Equal(got, data) {
		t.Fatal("a write acknowledged before the detach is not on the storage node's medium")
	}
}
