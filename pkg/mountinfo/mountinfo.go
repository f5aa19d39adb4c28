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

// Package mountinfo reads the mount points of this mount namespace from
// /proc/self/mountinfo (a dead FUSE mount cannot be stat'ed; the table
// still lists it).
package mountinfo

import (
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// Path is the mount table of the calling process's mount namespace.
const Path = "/proc/self/mountinfo"

// MountPoints returns the mount points listed in text (the content of a
// mountinfo file), unescaped, in table order.
func MountPoints(text string) []string {
	var out []string
	for line := range strings.SplitSeq(text, "\n") {
		if f := strings.Fields(line); len(f) > 4 {
			out = append(out, Unescape(f[4]))
		}
	}
	return out
}

// Read returns the mount points of this mount namespace.
func Read() ([]string, error) {
	b, err := os.ReadFile(Path)
	if err != nil {
		return nil, err
	}
	return MountPoints(string(b)), nil
}

// Under returns the mount points at or below dir, deepest first (a mount
// below another comes before it, the order to unmount them in).
func Under(mountPoints []string, dir string) []string {
	dir = filepath.Clean(dir)
	var out []string
	for _, mp := range mountPoints {
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if len(out[i]) != len(out[j]) {
			return len(out[i]) > len(out[j])
		}
		return out[i] < out[j]
	})
	return out
}

// Unescape undoes mountinfo's octal escapes (\040 for a space).
func Unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
