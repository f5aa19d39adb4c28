package driver

import (
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/datapath"
)

// TestToStatusLowerLayers: the sentinels of the lower layers, wrapped as
// they arrive, get the codes the sidecars retry on or report.
func TestToStatusLowerLayers(t *testing.T) {
	for _, c := range []struct {
		err  error
		want codes.Code
	}{
		{fmt.Errorf("%w: /run/dp.sock: connection refused", datapath.ErrUnavailable), codes.Unavailable},
		{fmt.Errorf("attach: %w", attach.ErrNotAttached), codes.NotFound},
		{fmt.Errorf("attach: %w", attach.ErrServerRefused), codes.FailedPrecondition},
		{fmt.Errorf("attach: %w", attach.ErrInvalid), codes.InvalidArgument},
		{fmt.Errorf("something else"), codes.Internal},
	} {
		if got := status.Code(toStatus(c.err)); got != c.want {
			t.Errorf("toStatus(%v) = %s, want %s", c.err, got, c.want)
		}
	}
}
