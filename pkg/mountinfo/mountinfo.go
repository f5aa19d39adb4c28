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

// Package mountinfo answers what is mounted where in this mount namespace.
// It reads the kernel's table (/proc/self/mountinfo), not the file system:
// a dead FUSE mount cannot be stat'ed, and the table still lists it. The
// table is parsed by github.com/moby/sys/mountinfo (escapes, optional
// fields); this package adds the two questions the driver asks of it.
package mountinfo

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"

	mi "github.com/moby/sys/mountinfo"
)

// Info is one mount of the table.
type Info = mi.Info

// Under returns the mount points at or below dir, deepest first (a mount
// below another comes before it: the order to unmount them in).
func Under(dir string) ([]string, error) {
	infos, err := mi.GetMounts(mi.PrefixFilter(filepath.Clean(dir)))
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(infos))
	for _, m := range infos {
		out = append(out, m.Mountpoint)
	}
	sort.SliceStable(out, func(i, j int) bool {
		if len(out[i]) != len(out[j]) {
			return len(out[i]) > len(out[j])
		}
		return out[i] < out[j]
	})
	return out, nil
}

// At returns the topmost mount at path, nil when path is no mount point.
func At(path string) (*Info, error) {
	infos, err := mi.GetMounts(at(path))
	return last(infos), err
}

// AtIn is At over the table read from r (another process's, a test's).
func AtIn(r io.Reader, path string) (*Info, error) {
	infos, err := mi.GetMountsFromReader(r, at(path))
	return last(infos), err
}

// Of returns the mount table of process pid's mount namespace.
func Of(pid int) ([]*Info, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return mi.GetMountsFromReader(f, nil)
}

// HasDevice reports whether a file system of device major:minor (st_dev)
// is mounted in this mount namespace.
func HasDevice(major, minor int) (bool, error) {
	infos, err := mi.GetMounts(func(m *Info) (skip, stop bool) {
		match := m.Major == major && m.Minor == minor
		return !match, match
	})
	return len(infos) > 0, err
}

// at keeps the mounts at path; the table lists a mount after the ones it
// covers, so the last is the one path shows.
func at(path string) mi.FilterFunc {
	path = filepath.Clean(path)
	return func(m *Info) (skip, stop bool) { return m.Mountpoint != path, false }
}

func last(infos []*Info) *Info {
	if len(infos) == 0 {
		return nil
	}
	return infos[len(infos)-1]
}
