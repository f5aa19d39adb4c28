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

package nbdnl

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakeSys lays out a sysfs tree below a temp dir.
type fakeSys struct {
	t    *testing.T
	root string
}

func newFakeSys(t *testing.T) fakeSys {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "block"), 0o755); err != nil {
		t.Fatal(err)
	}
	return fakeSys{t, root}
}

func (f fakeSys) write(rel, content string) {
	f.t.Helper()
	p := filepath.Join(f.root, "block", rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		f.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		f.t.Fatal(err)
	}
}

func (f fakeSys) sys() Sysfs { return Sysfs{Root: f.root} }

func TestDevicePath(t *testing.T) {
	if got := DevicePath(12); got != "/dev/nbd12" {
		t.Fatalf("DevicePath(12) = %q", got)
	}
}

func TestWaitReadyAtOnce(t *testing.T) {
	tree := newFakeSys(t)
	tree.write("nbd2/pid", "1234\n")
	tree.write("nbd2/size", "2048\n")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := tree.sys().WaitReady(ctx, 2, 1<<20); err != nil {
		t.Fatal(err)
	}
}

func TestWaitReadyAfterAWhile(t *testing.T) {
	tree := newFakeSys(t)
	tree.write("nbd0/size", "0\n")
	go func() {
		time.Sleep(50 * time.Millisecond)
		tree.write("nbd0/size", "8\n")
		tree.write("nbd0/pid", "99\n")
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tree.sys().WaitReady(ctx, 0, 4096); err != nil {
		t.Fatal(err)
	}
}

func TestWaitReadyTimesOut(t *testing.T) {
	tests := []struct {
		name  string
		files map[string]string
		want  string
	}{
		{"no device", nil, "no device"},
		{"not started", map[string]string{"nbd1/size": "0\n"}, "not started"},
		{"wrong size", map[string]string{"nbd1/pid": "7\n", "nbd1/size": "8\n"}, "size is 4096 bytes, want 1048576"},
		{"bad size", map[string]string{"nbd1/pid": "7\n", "nbd1/size": "x\n"}, "cannot parse size"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tree := newFakeSys(t)
			for rel, content := range tt.files {
				tree.write(rel, content)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Millisecond)
			defer cancel()
			err := tree.sys().WaitReady(ctx, 1, 1<<20)
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("err %v, want a deadline error", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err %q does not say %q", err, tt.want)
			}
		})
	}
}

func TestBackend(t *testing.T) {
	tree := newFakeSys(t)
	tree.write("nbd3/backend", "pvc-1234\n")
	tree.write("nbd4/backend", "\n")
	if got, err := tree.sys().Backend(3); err != nil || got != "pvc-1234" {
		t.Fatalf("Backend(3) = %q, %v", got, err)
	}
	if got, err := tree.sys().Backend(4); err != nil || got != "" {
		t.Fatalf("Backend(4) = %q, %v", got, err)
	}
	if _, err := tree.sys().Backend(5); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Backend(5): %v, want not-exist", err)
	}
}

func TestFindByBackend(t *testing.T) {
	tree := newFakeSys(t)
	tree.write("nbd10/backend", "vol-a\n")
	tree.write("nbd2/backend", "vol-a\n")
	tree.write("nbd1/backend", "vol-b\n")
	tree.write("nbd0/size", "0\n") // not connected: no backend attribute
	tree.write("nbdx/backend", "vol-c\n")
	tree.write("loop0/backend", "vol-c\n")
	tree.write("nbd3p1/backend", "vol-c\n")

	if index, ok, err := tree.sys().FindByBackend("vol-a"); err != nil || !ok || index != 2 {
		t.Fatalf("vol-a: %d, %v, %v; want 2", index, ok, err)
	}
	if index, ok, err := tree.sys().FindByBackend("vol-b"); err != nil || !ok || index != 1 {
		t.Fatalf("vol-b: %d, %v, %v; want 1", index, ok, err)
	}
	if _, ok, err := tree.sys().FindByBackend("vol-c"); err != nil || ok {
		t.Fatalf("vol-c: %v, %v; want not found", ok, err)
	}
	if _, _, err := tree.sys().FindByBackend(""); err == nil {
		t.Fatal("empty id: want an error")
	}
	if _, _, err := (Sysfs{Root: t.TempDir()}).FindByBackend("vol-a"); err == nil {
		t.Fatal("no block dir: want an error")
	}
}
