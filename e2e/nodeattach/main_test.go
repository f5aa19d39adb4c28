package nodeattach

import (
	"os"
	"testing"

	"github.com/mpnbd/mpnbd/pkg/attach/ublkdev"
)

// TestMain lets the test binary be a ublk volume's server process, as the
// node plugin's executable is.
func TestMain(m *testing.M) {
	if ublkdev.ServeRequested() {
		os.Exit(ublkdev.ServeMain())
	}
	os.Exit(m.Run())
}
