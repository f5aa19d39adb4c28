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

package nbd

import (
	"path/filepath"
	"testing"
)

func TestIncarnationStore(t *testing.T) {
	boot, err := BootIncarnation()
	if err != nil {
		t.Skipf("no boot ID here: %v", err)
	}
	st := IncarnationStore{Path: filepath.Join(t.TempDir(), "salt")}
	if cur, err := st.Current(); err != nil || cur != boot {
		t.Fatalf("with nothing lost: %x, %v; want the boot incarnation", cur, err)
	}
	lost, err := st.Lost()
	if err != nil {
		t.Fatal(err)
	}
	if lost == boot {
		t.Fatal("the incarnation did not change when writes were lost")
	}
	// The next start on this boot announces the changed incarnation.
	again := IncarnationStore{Path: st.Path}
	if cur, err := again.Current(); err != nil || cur != lost {
		t.Fatalf("after a restart: %x, %v; want %x", cur, err, lost)
	}
	if lost2, err := again.Lost(); err != nil || lost2 == lost {
		t.Fatalf("a second loss: %x, %v; want a new incarnation", lost2, err)
	}

	mem := IncarnationStore{}
	a, err := mem.Lost()
	if err != nil || a == boot {
		t.Fatalf("without a file: %x, %v", a, err)
	}
	if cur, _ := mem.Current(); cur != boot {
		t.Fatal("without a file the loss outlived the process")
	}
}
