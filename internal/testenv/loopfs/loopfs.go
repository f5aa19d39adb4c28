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

// Package loopfs gives tests real filesystems: a sparse image formatted
// with XFS (reflink on) or ext4, mounted through a loop device, and the
// checksums tests compare files by.
package loopfs

import (
	"crypto/sha256"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// mkfs are the commands that format an image, by filesystem type.
var mkfs = map[string][]string{
	"xfs":  {"mkfs.xfs", "-q", "-f", "-m", "reflink=1"},
	"ext4": {"mkfs.ext4", "-q", "-F", "-E", "nodiscard"},
}

// Mount makes a sparse image of size bytes, formats it with fstype ("xfs",
// with reflink, or "ext4"), attaches it to a loop device and mounts it in a
// temporary directory, whose path it returns. Cleanups unmount it and
// detach the device. Without root, the tools or a loop device the test is
// skipped, saying why.
func Mount(t testing.TB, fstype string, size int64) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skipf("skipping: mounting a loop-backed %s needs root (euid %d)", fstype, os.Geteuid())
	}
	cmd, ok := mkfs[fstype]
	if !ok {
		t.Fatalf("loopfs: no mkfs for %q", fstype)
	}
	for _, tool := range []string{cmd[0], "losetup", "mount", "umount"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipping: %s not found: %v", tool, err)
		}
	}
	dir := t.TempDir()
	img := filepath.Join(dir, fstype+".img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, size); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(cmd[0], append(cmd[1:], img)...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v: %s", strings.Join(cmd, " "), err, out)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Skipf("skipping: no loop device: losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
			t.Errorf("cleanup: losetup -d %s: %v: %s", dev, err, out)
		}
	})
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", fstype, dev, mnt).CombinedOutput(); err != nil {
		t.Skipf("skipping: mount -t %s %s: %v: %s", fstype, dev, err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("cleanup: umount %s: %v: %s", mnt, err, out)
		}
	})
	return mnt
}

// Checksum is the SHA-256 of the file at path.
func Checksum(t testing.TB, path string) [sha256.Size]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return [sha256.Size]byte(h.Sum(nil))
}
