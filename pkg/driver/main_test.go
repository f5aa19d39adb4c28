package driver

import (
	"os"
	"testing"

	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
)

// TestMain lets the test binary be a fuse volume's server process, as the
// node plugin's executable is (the fuse Attacher runs its own executable
// again to start one).
func TestMain(m *testing.M) {
	if fuse.ServeRequested() {
		os.Exit(fuse.ServeMain())
	}
	os.Exit(m.Run())
}
