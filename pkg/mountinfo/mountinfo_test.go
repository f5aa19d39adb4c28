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
	"slices"
	"strings"
	"testing"
)

func TestUnescape(t *testing.T) {
	for in, want := range map[string]string{
		`/run/a`:          "/run/a",
		`/run/a\040b`:     "/run/a b",
		`/x\134y`:         `/x\y`,
		`/trailing\04`:    `/trailing\04`,
		`/t\011ab\012end`: "/t\tab\nend",
	} {
		if got := Unescape(in); got != want {
			t.Errorf("Unescape(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestUnder(t *testing.T) {
	mi := `22 1 8:1 / / rw shared:1 - ext4 /dev/vda rw
30 22 0:50 / /tmp/dd/node-state/fuse/v rw - fuse /dev/fuse rw
31 22 7:1 / /tmp/dd/kubelet/staging/v rw - ext4 /dev/loop1 rw
32 22 7:1 / /tmp/dd/kubelet/pod\040a/mount rw - ext4 /dev/loop1 rw
33 22 0:51 / /tmp/ddx rw - tmpfs tmpfs rw
`
	if got := MountPoints(mi); len(got) != 5 || got[3] != "/tmp/dd/kubelet/pod a/mount" {
		t.Errorf("MountPoints = %q", got)
	}
	got := Under(MountPoints(mi), "/tmp/dd/")
	want := []string{"/tmp/dd/kubelet/pod a/mount", "/tmp/dd/kubelet/staging/v", "/tmp/dd/node-state/fuse/v"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("got %q, want %q (deepest first, not /tmp/ddx)", got, want)
	}
}

func TestRead(t *testing.T) {
	mps, err := Read()
	if err != nil {
		t.Skipf("no %s here: %v", Path, err)
	}
	if !slices.Contains(mps, "/") {
		t.Errorf("the root is not among the mount points %q", mps)
	}
}
