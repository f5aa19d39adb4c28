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

// Package capability answers whether this process holds a Linux capability,
// from /proc/self/status.
package capability

import (
	"os"
	"strconv"
	"strings"
)

// SysResource is CAP_SYS_RESOURCE's number (linux/capability.h): the
// kernel's online resize of ext4 needs it.
const SysResource = 24

// Set names a capability set of /proc/self/status.
type Set string

const (
	// Effective is what the process may use now (CapEff).
	Effective Set = "CapEff"
	// Bounding is what it and its children can ever hold (CapBnd).
	Bounding Set = "CapBnd"
)

// Has reports whether capability number c is in this process's set s. When
// the set cannot be read it answers true: unknown says nothing of it.
func Has(s Set, c uint) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return true
	}
	return in(string(b), s, c)
}

// in is Has over the text of a status file.
func in(status string, s Set, c uint) bool {
	for line := range strings.SplitSeq(status, "\n") {
		if v, ok := strings.CutPrefix(line, string(s)+":"); ok {
			bits, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err != nil || bits&(1<<c) != 0
		}
	}
	return true
}
