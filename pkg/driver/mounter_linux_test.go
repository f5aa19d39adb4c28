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

package driver

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/internal/capability"
)

// rootTools skips t unless it runs as root with every tool named, and
// returns what runs a command, failing t with its output.
func rootTools(t *testing.T, tools ...string) func(name string, args ...string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skipf("skipping: loop devices and mounts need root (euid %d)", os.Geteuid())
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipping: %s not found: %v", tool, err)
		}
	}
	return func(name string, args ...string) string {
		t.Helper()
		out, err := exec.Command(name, args...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
		}
		return strings.TrimSpace(string(out))
	}
}

// TestMounterGrowUnmounted: an ext4 file system copied while mounted (as
// a snapshot is taken: its journal still to be replayed) onto a larger
// device is checked and grown before its first mount, and keeps its
// data; a second call finds nothing to do; an unformatted device is left
// alone.
func TestMounterGrowUnmounted(t *testing.T) {
	run := rootTools(t, "mkfs.ext4", "e2fsck", "resize2fs", "dumpe2fs", "blkid", "blockdev", "losetup", "mount", "umount")
	loop := func(img string) string {
		t.Helper()
		dev := run("losetup", "--find", "--show", img)
		t.Cleanup(func() { _ = exec.Command("losetup", "-d", dev).Run() })
		return dev
	}
	dir := t.TempDir()
	src, copyImg := filepath.Join(dir, "src.img"), filepath.Join(dir, "copy.img")
	if err := os.WriteFile(src, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(src, 64<<20); err != nil {
		t.Fatal(err)
	}
	run("mkfs.ext4", "-q", "-F", src)
	srcDev := loop(src)
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	run("mount", srcDev, mnt)
	data := bytes.Repeat([]byte("kept across the grow "), 1<<15)
	if err := os.WriteFile(filepath.Join(mnt, "data"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	// Copied while mounted: the copy's journal needs recovery.
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(copyImg, b, 0o600); err != nil {
		t.Fatal(err)
	}
	run("umount", mnt)
	if err := os.Truncate(copyImg, 128<<20); err != nil {
		t.Fatal(err)
	}
	dev := loop(copyImg)

	m := NewMounter()
	grown, err := m.GrowUnmounted(dev)
	if err != nil || !grown {
		t.Fatalf("GrowUnmounted on a 64 MiB ext4 in a 128 MiB device: %v, %v", grown, err)
	}
	if grown, err := m.GrowUnmounted(dev); err != nil || grown {
		t.Errorf("GrowUnmounted again: %v, %v; want nothing to do", grown, err)
	}
	run("mount", dev, mnt)
	t.Cleanup(func() { _ = exec.Command("umount", mnt).Run() })
	var st unix.Statfs_t
	if err := unix.Statfs(mnt, &st); err != nil {
		t.Fatal(err)
	}
	if size := int64(st.Blocks) * st.Bsize; size < 100<<20 {
		t.Errorf("file system of %d bytes after the grow, want about 128 MiB", size)
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "data")); err != nil || !bytes.Equal(got, data) {
		t.Errorf("the data after the grow: %v, intact %v", err, bytes.Equal(got, data))
	}

	blank := filepath.Join(dir, "blank.img")
	if err := os.WriteFile(blank, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(blank, 16<<20); err != nil {
		t.Fatal(err)
	}
	if grown, err := m.GrowUnmounted(loop(blank)); err != nil || grown {
		t.Errorf("GrowUnmounted on an unformatted device: %v, %v", grown, err)
	}
}

// TestMounterGrowMountedExt4: a mounted ext4 file system on a loop device
// whose file grew is grown in place where this process has
// CAP_SYS_RESOURCE (the kernel's online resize needs it); where it has not
// (hosts whose bounding set leaves it out), Resize fails with an error
// that names the capability and what to do, and FailedPrecondition's
// sentinel, instead of resize2fs's bare "Permission denied".
func TestMounterGrowMountedExt4(t *testing.T) {
	run := rootTools(t, "mkfs.ext4", "resize2fs", "blkid", "losetup", "mount", "umount")
	dir := t.TempDir()
	img, mnt := filepath.Join(dir, "vol.img"), filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 64<<20); err != nil {
		t.Fatal(err)
	}
	run("mkfs.ext4", "-q", "-F", img)
	dev := run("losetup", "--find", "--show", img)
	t.Cleanup(func() { _ = exec.Command("losetup", "-d", dev).Run() })
	run("mount", dev, mnt)
	t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })
	var before unix.Statfs_t
	if err := unix.Statfs(mnt, &before); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 256<<20); err != nil {
		t.Fatal(err)
	}
	run("losetup", "--set-capacity", dev)

	m := NewMounter()
	grown, err := m.Resize(dev, mnt)
	if capability.Has(capability.Effective, capability.SysResource) {
		if err != nil || !grown {
			t.Fatalf("Resize with CAP_SYS_RESOURCE: %v, %v", grown, err)
		}
		var after unix.Statfs_t
		if err := unix.Statfs(mnt, &after); err != nil {
			t.Fatal(err)
		}
		if after.Blocks*uint64(after.Bsize) < 3*before.Blocks*uint64(before.Bsize) {
			t.Errorf("the file system has %d bytes after growing, %d before", after.Blocks*uint64(after.Bsize), before.Blocks*uint64(before.Bsize))
		}
		return
	}
	t.Logf("this process lacks CAP_SYS_RESOURCE: the online resize must fail with a clear error")
	if err == nil {
		t.Fatal("Resize of a mounted ext4 without CAP_SYS_RESOURCE succeeded: the capability check is wrong")
	}
	if !errors.Is(err, ErrPrecondition) || !strings.Contains(err.Error(), "CAP_SYS_RESOURCE") || !strings.Contains(err.Error(), "offline") {
		t.Errorf("the error does not say why and what to do: %v", err)
	}
}
