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

package fuse

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// The test binary is also the server process (the default ServeCommand
// runs the executable again with ServeEnv set) and, with attachHelperEnv
// set, an attaching process that tests kill.
func TestMain(m *testing.M) {
	if d, err := time.ParseDuration(os.Getenv(handoffTimeoutEnv)); err == nil {
		handoffTimeout = d
	}
	if ServeRequested() {
		os.Exit(ServeMain())
	}
	if spec := os.Getenv(attachHelperEnv); spec != "" {
		os.Exit(attachHelper(spec))
	}
	if dir := os.Getenv(handoffHelperEnv); dir != "" {
		os.Exit(handoffHelper(dir))
	}
	// Under the race detector every process sleeps a second before it
	// exits, which each detach would wait for.
	if os.Getenv("GORACE") == "" {
		os.Setenv("GORACE", "atexit_sleep_ms=0")
	}
	os.Exit(m.Run())
}

const attachHelperEnv = "MPNBD_FUSE_TEST_ATTACH"

// handoffTimeoutEnv sets handoffTimeout in the test's processes.
const handoffTimeoutEnv = "MPNBD_FUSE_TEST_HANDOFF_TIMEOUT"

// attachHelperSpec is what the attaching helper attaches.
type attachHelperSpec struct {
	StateDir string
	Target   attach.Target
}

// attachHelperResult is what it prints on standard output.
type attachHelperResult struct {
	Attachment *attach.Attachment
	Err        string
}

// attachHelper attaches a volume with a fresh Attacher, prints the
// outcome as JSON and waits for standard input to close (or to be
// killed), without detaching.
func attachHelper(spec string) int {
	var sp attachHelperSpec
	if err := json.Unmarshal([]byte(spec), &sp); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	a := New(Config{StateDir: sp.StateDir})
	var res attachHelperResult
	att, err := a.Attach(context.Background(), sp.Target, attach.Options{})
	if err != nil {
		res.Err = err.Error()
	}
	res.Attachment = att
	if err := json.NewEncoder(os.Stdout).Encode(res); err != nil {
		return 2
	}
	// Until the test closes our standard input: how is no matter.
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}
