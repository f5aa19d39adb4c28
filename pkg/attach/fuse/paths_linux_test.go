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
	"context"
	"io"
	"os"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// TestPathsOverFourPaths moves data both ways through a FUSE-attached
// volume carried by one MPTCP connection with a subflow on each of 4
// paths, and checks the bytes per path Health reports (from the server
// process, through its control socket): every path carried some each
// way, and together at least what was written and read.
func TestPathsOverFourPaths(t *testing.T) {
	tp, ts, a := fourPaths(t, "fp", 128<<20)
	ctx := context.Background()
	const vol = "pv-paths"
	att, err := a.Attach(ctx, target(vol, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !att.MPTCP {
		t.Fatalf("attachment %+v does not run MPTCP", att)
	}
	// All 4 subflows first, so every path takes its share.
	deadline := time.Now().Add(10 * time.Second)
	for {
		h, err := a.Health(vol)
		if err != nil {
			t.Fatal(err)
		}
		if len(h.Subflows) == 1 && h.Subflows[0] == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("health %+v: 4 subflows expected within 10 s", h)
		}
		time.Sleep(50 * time.Millisecond)
	}

	const size = 32 << 20
	f, err := os.OpenFile(att.Device, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	for off := int64(0); off < size; off += int64(len(buf)) {
		if _, err := f.WriteAt(buf, off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	// Read a region never written: nothing of it is cached here.
	if _, err := io.Copy(io.Discard, io.NewSectionReader(f, size, size)); err != nil {
		t.Fatal(err)
	}

	h, err := a.Health(vol)
	if err != nil {
		t.Fatal(err)
	}
	if len(h.Paths) != 4 {
		t.Fatalf("health paths %+v, want 4", h.Paths)
	}
	var sent, recv uint64
	seen := map[int]bool{}
	for _, p := range h.Paths {
		t.Logf("connection %d: %s -> %s sent %d received %d", p.Connection, p.Local, p.Remote, p.SentBytes, p.ReceivedBytes)
		path := tp.PathOf(p.Remote.Addr())
		if p.Connection != 0 || path == 0 || p.Local.Addr() != tp.ClientAddr(path) {
			t.Errorf("path %+v: not connection 0 from the client's address of one path", p)
		}
		seen[path] = true
		if p.SentBytes == 0 || p.ReceivedBytes == 0 {
			t.Errorf("path %d (%s -> %s) carried nothing one way: sent %d, received %d", path, p.Local, p.Remote, p.SentBytes, p.ReceivedBytes)
		}
		sent += p.SentBytes
		recv += p.ReceivedBytes
	}
	if len(seen) != 4 {
		t.Errorf("subflows on paths %v, want all 4", seen)
	}
	if sent < size || recv < size {
		t.Errorf("paths sent %d and received %d bytes in all; %d written and %d read", sent, recv, size, size)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Detach(ctx, vol); err != nil {
		t.Fatal(err)
	}
}
