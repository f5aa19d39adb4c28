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

package attach

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/mpnbd/mpnbd/pkg/blockdev"
)

func TestWireError(t *testing.T) {
	orig := errors.Join(errors.New("context"), blockdev.ErrLoopBusy)
	b, err := json.Marshal(EncodeError(orig))
	if err != nil {
		t.Fatal(err)
	}
	var w WireError
	if err := json.Unmarshal(b, &w); err != nil {
		t.Fatal(err)
	}
	got := w.Err()
	if got.Error() != orig.Error() {
		t.Errorf("message %q, want %q", got, orig)
	}
	if !errors.Is(got, blockdev.ErrLoopBusy) {
		t.Error("the decoded error is not ErrLoopBusy")
	}
	if errors.Is(got, ErrServerRefused) {
		t.Error("the decoded error is ErrServerRefused")
	}
	if !IsRemote(got) || IsRemote(orig) {
		t.Error("IsRemote does not tell a decoded error from a local one")
	}
	// The names are on the wire: a change breaks older processes.
	if want := `{"message":"context\nblockdev: loop device busy","kinds":["loop-busy"]}`; string(b) != want {
		t.Errorf("wire form %s", b)
	}
	if EncodeError(nil) != nil || (*WireError)(nil).Err() != nil {
		t.Error("nil does not stay nil")
	}
}
