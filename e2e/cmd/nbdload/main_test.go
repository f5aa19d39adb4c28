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

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/e2e/bench"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

func serve(t *testing.T) string {
	t.Helper()
	s := &nbd.Server{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := s.AddExport(&nbd.Export{Name: "bench", Backend: nbd.NewMemBackend(4 << 20)}); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.Shutdown(ctx)
		l.Close()
	})
	return l.Addr().String()
}

func TestRunPrintsJSON(t *testing.T) {
	addr := serve(t)
	for _, args := range [][]string{
		{"--rw", "randwrite", "--bs", "4k", "--qd", "4", "--time", "100ms", "--warmup", "10ms", "--span", "1M"},
		{"--rw", "write", "--bs", "64k", "--verify", "--span", "1M"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), append([]string{"--addr", addr, "--export", "bench"}, args...), &stdout, &stderr)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", args, code, stderr.String())
		}
		var rep bench.LoadReport
		if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
			t.Fatalf("%v: output is not one JSON report: %v\n%s", args, err, stdout.String())
		}
		if !rep.OK() || rep.Span != 1<<20 || rep.RW != args[1] {
			t.Errorf("%v: report %+v", args, rep)
		}
		if strings.Count(strings.TrimSpace(stdout.String()), "\n") != 0 {
			t.Errorf("%v: more than one line of output", args)
		}
	}
}

func TestRunFailures(t *testing.T) {
	addr := serve(t)
	for _, tc := range []struct {
		args []string
		code int
	}{
		{[]string{"--export", "bench"}, 2},                                            // no address
		{[]string{"--addr", addr, "--rw", "mixed"}, 2},                                // bad pattern
		{[]string{"--addr", addr, "--bs", "1X"}, 2},                                   // bad size
		{[]string{"--addr", addr, "extra"}, 2},                                        // stray argument
		{[]string{"--addr", addr, "--export", "nope", "--time", "50ms"}, 1},           // unknown export
		{[]string{"--addr", "127.0.0.1:1", "--export", "bench", "--time", "50ms"}, 1}, // refused
	} {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), tc.args, &stdout, &stderr); code != tc.code {
			t.Errorf("%v: exit %d, want %d (%s)", tc.args, code, tc.code, stderr.String())
		}
	}
}

func TestRunExportFile(t *testing.T) {
	addr := serve(t)
	file := filepath.Join(t.TempDir(), "export")
	if err := os.WriteFile(file, []byte("bench\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"--addr", addr, "--export-file", file, "--rw", "write", "--bs", "64k",
		"--time", "50ms", "--span", "1M"}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	var rep bench.LoadReport
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatal(err)
	}
	if !rep.OK() || rep.Export != "" || strings.Contains(stdout.String(), "bench") {
		t.Errorf("report %+v, want data moved and no export name in it:\n%s", rep, stdout.String())
	}

	for _, tc := range []struct {
		args []string
		code int
	}{
		{[]string{"--addr", addr, "--export", "bench", "--export-file", file}, 2}, // both
		{[]string{"--addr", addr, "--export-file", file + ".missing"}, 2},
	} {
		stdout.Reset()
		stderr.Reset()
		if code := run(context.Background(), tc.args, &stdout, &stderr); code != tc.code {
			t.Errorf("%v: exit %d, want %d (%s)", tc.args, code, tc.code, stderr.String())
		}
	}
}

// --measure-from starts the measured window at the given instant, and a
// load that starts after it fails, naming why; a bad time is a usage
// error.
func TestRunMeasureFrom(t *testing.T) {
	addr := serve(t)
	base := []string{"--addr", addr, "--export", "bench", "--rw", "write", "--bs", "64k", "--time", "100ms", "--span", "1M"}
	from := time.Now().Add(300 * time.Millisecond)
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), append(base, "--measure-from", from.Format(time.RFC3339Nano)), &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	var rep bench.LoadReport
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatal(err)
	}
	if d := rep.WindowStart.Sub(from); !rep.OK() || d < 0 || d > time.Second {
		t.Errorf("window began %v after --measure-from (report %+v), want at it", d, rep)
	}

	stdout.Reset()
	stderr.Reset()
	past := time.Now().Add(-time.Second).Format(time.RFC3339Nano)
	if code := run(context.Background(), append(base, "--measure-from", past), &stdout, &stderr); code != 1 {
		t.Fatalf("a window begun before the load: exit %d, want 1", code)
	}
	if !strings.Contains(stderr.String(), "after the measured window began") {
		t.Errorf("a window begun before the load: %s", stderr.String())
	}
	if code := run(context.Background(), append(base, "--measure-from", "soon"), &stdout, &stderr); code != 2 {
		t.Errorf("--measure-from soon: exit %d, want 2", code)
	}
}
