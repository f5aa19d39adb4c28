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
