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

//go:build linux

package bench

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// IsTmpfs reports whether dir is on a tmpfs.
func IsTmpfs(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, err
	}
	return uint32(st.Type) == unix.TMPFS_MAGIC, nil
}

// EnsureTmpfs returns dir when it is on a tmpfs. Otherwise it mounts a
// private tmpfs (needs root) and returns its path and a function that
// unmounts and removes it.
func EnsureTmpfs(dir string) (string, func(), error) {
	if ok, err := IsTmpfs(dir); err == nil && ok {
		return dir, func() {}, nil
	}
	mnt, err := os.MkdirTemp("", "mpnbd-bench-tmpfs-")
	if err != nil {
		return "", nil, err
	}
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=10g,mode=0700"); err != nil {
		os.Remove(mnt)
		return "", nil, fmt.Errorf("%s is not a tmpfs and mounting one failed: %w", dir, err)
	}
	return mnt, func() {
		_ = unix.Unmount(mnt, unix.MNT_DETACH) // lazy: fails only if not mounted
		os.Remove(mnt)
	}, nil
}
