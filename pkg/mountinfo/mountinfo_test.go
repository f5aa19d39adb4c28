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

package mountinfo

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

const table = `22 27 0:21 / /proc rw,relatime - proc proc rw
412 27 7:3 / /w/kubelet/staging/pvc-1 rw,relatime - xfs /dev/loop3 rw,attr2,noquota
413 27 7:3 / /w/kubelet/pod\040x/volume rw,relatime - xfs /dev/loop3 rw,attr2,noquota
414 27 0:6 /loop4 /w/kubelet/pod-block/volume rw,nosuid - devtmpfs udev rw,size=1k
415 413 0:30 / /w/kubelet/pod\040x/volume rw shared:7 - tmpfs over rw
`

func TestAtIn(t *testing.T) {
	m, err := AtIn(strings.NewReader(table), "/w/kubelet/pod x/volume")
	if err != nil || m == nil {
		t.Fatalf("AtIn: %v, %v", m, err)
	}
	// The escaped space is undone, and the topmost mount is the one given.
	if m.FSType != "tmpfs" || m.Source != "over" {
		t.Errorf("the topmost mount at a path mounted twice: %+v", m)
	}
	if m, err := AtIn(strings.NewReader(table), "/w/kubelet/pod-block/volume/"); err != nil || m == nil || m.Root != "/loop4" {
		t.Errorf("a bind of a device, the path with a trailing slash: %+v, %v", m, err)
	}
	if m, err := AtIn(strings.NewReader(table), "/w/kubelet"); err != nil || m != nil {
		t.Errorf("a path that is no mount point: %+v, %v", m, err)
	}
}

// TestUnder mounts tmpfs at a directory, below it and at a name with a
// space, and finds them deepest first (needs root: a mount of its own).
func TestUnder(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipping: mounting needs root")
	}
	dir := t.TempDir()
	paths := []string{dir, filepath.Join(dir, "a b"), filepath.Join(dir, "a b", "c")}
	for _, p := range paths {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("tmpfs", p, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatalf("mount %s: %v", p, err)
		}
		t.Cleanup(func() { _ = unix.Unmount(p, unix.MNT_DETACH) })
	}
	got, err := Under(dir + "/")
	if err != nil {
		t.Fatal(err)
	}
	want := slices.Clone(paths)
	slices.Reverse(want)
	if !slices.Equal(got, want) {
		t.Errorf("Under(%s) = %q, want %q", dir, got, want)
	}
	if m, err := At(paths[1]); err != nil || m == nil || m.FSType != "tmpfs" {
		t.Errorf("At(%s) = %+v, %v", paths[1], m, err)
	}
	if got, err := Under(filepath.Join(dir, "a")); err != nil || len(got) != 0 {
		t.Errorf("Under a sibling's prefix: %q, %v", got, err)
	}
}
