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
