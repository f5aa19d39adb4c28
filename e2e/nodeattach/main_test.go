package nodeattach

import (
	"os"
	"testing"

	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/attach/ublkdev"
)

// TestMain lets the test binary be a ublk or fuse volume's server
// process, as the node plugin's executable is.
func TestMain(m *testing.M) {
	if ublkdev.ServeRequested() {
		os.Exit(ublkdev.ServeMain())
	}
	if fuse.ServeRequested() {
		os.Exit(fuse.ServeMain())
	}
	os.Exit(m.Run())
}
