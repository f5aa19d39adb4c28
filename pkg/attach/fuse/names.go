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
	"crypto/sha256"
	"encoding/hex"
	"regexp"
	"strings"
)

var plainName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// reservedSuffixes end the names of a volume's files next to its mount
// point; a volume ID ending so would collide with another volume's files.
var reservedSuffixes = []string{".lock", ".json", ".sock", ".tmp"}

// volumeName is the name of a volume's mount directory and file: the
// volume ID itself when it is a plain file name, else a digest of it.
func volumeName(volumeID string) string {
	if plainName.MatchString(volumeID) && !hasReservedSuffix(volumeID) {
		return volumeID
	}
	sum := sha256.Sum256([]byte(volumeID))
	return "v-" + hex.EncodeToString(sum[:16])
}

func hasReservedSuffix(s string) bool {
	for _, x := range reservedSuffixes {
		if strings.HasSuffix(s, x) {
			return true
		}
	}
	return false
}
