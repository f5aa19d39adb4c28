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
