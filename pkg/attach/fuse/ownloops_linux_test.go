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
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/blockdev"
)

// TestDetachLoopsLeavesOtherMountNamespaces: another mount namespace
// binds a loop device to a file at the very path of one of ours (on a
// file system only it has mounted: another node of a cluster sharing this
// host's kernel). The kernel reports the same backing path for both
// devices; detachLoops detaches ours and leaves the other alone (it used
// to try to detach both, and failed on the other's busy device).
func TestDetachLoopsLeavesOtherMountNamespaces(t *testing.T) {
	requireFUSE(t)
	requireTool(t, "unshare")
	requireTool(t, "losetup")
	dir := t.TempDir()
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(mnt, "file")
	ready := filepath.Join(dir, "other-loop")
	other := exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c",
		`mount -t tmpfs other "$1" && truncate -s 1M "$1/file" && losetup --find --show "$1/file" > "$2.tmp" && mv "$2.tmp" "$2" && exec sleep 120`,
		"sh", mnt, ready)
	other.Stderr = os.Stderr
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	var otherDev string
	t.Cleanup(func() {
		_ = other.Process.Kill()
		_ = other.Wait() // killed
		if otherDev != "" {
			// Its file system went with its namespace; the device may be
			// bound still (this test failed before detaching it).
			_ = exec.Command("losetup", "-d", otherDev).Run()
		}
	})
	for deadline := time.Now().Add(10 * time.Second); ; {
		if b, err := os.ReadFile(ready); err == nil {
			otherDev = strings.TrimSpace(string(b))
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the other mount namespace bound no loop device in 10 s")
		}
		time.Sleep(20 * time.Millisecond)
	}

	if err := syscall.Mount("ours", mnt, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(mnt, syscall.MNT_DETACH) })
	if err := os.WriteFile(file, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	ownDev, err := blockdev.AttachLoop(file, blockdev.LoopOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = blockdev.DetachLoop(ownDev) })

	found, err := blockdev.FindLoopByBackingFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(found, ownDev) || !slices.Contains(found, otherDev) {
		t.Fatalf("the kernel reports %v bound to %s; want ours (%s) and the other namespace's (%s) alike", found, file, ownDev, otherDev)
	}
	if err := detachLoops(file, ""); err != nil {
		t.Fatalf("detachLoops: %v", err)
	}
	if _, err := blockdev.StatLoop(ownDev); !errors.Is(err, syscall.ENXIO) {
		t.Errorf("our loop device %s is still bound (%v)", ownDev, err)
	}
	if st, err := blockdev.StatLoop(otherDev); err != nil {
		t.Errorf("the other namespace's loop device %s was detached: %v", otherDev, err)
	} else if st.BackingFile != file {
		t.Errorf("the other namespace's loop device %s backs %q", otherDev, st.BackingFile)
	}
}
