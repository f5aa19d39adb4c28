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

//go:build !linux

package snapshot

import "os"

// Space is what a file uses on disk.
type Space struct {
	// Allocated is the bytes of the file's blocks, the shared ones
	// included (the file's size where allocation is not known).
	Allocated int64
	// Shared is the bytes of the file's extents that the filesystem shares
	// with another file (a reflink); always 0 here, where extents are not
	// mapped.
	Shared int64
}

// Usage reports the space the file at path uses: its allocated bytes as
// far as they are known, and no sharing.
func Usage(path string) (Space, error) {
	f, err := os.Open(path)
	if err != nil {
		return Space{}, err
	}
	defer f.Close()
	alloc, err := allocated(f)
	if err != nil {
		return Space{}, err
	}
	return Space{Allocated: alloc}, nil
}
