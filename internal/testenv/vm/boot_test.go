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

package vm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestRunBootsAgainAfterABootPanic: a kernel that panics before the
// payload begins is booted again, up to bootAttempts times; a guest that
// ends another way is not. qemu is a script that counts its runs.
func TestRunBootsAgainAfterABootPanic(t *testing.T) {
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("no busybox:", err)
	}
	for _, tc := range []struct {
		name    string
		console string
		want    int
	}{
		{"panic while booting", "[    1.70] Kernel panic - not syncing: Fatal exception in interrupt", bootAttempts},
		{"no status, no panic", "[    1.70] something else", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			count := filepath.Join(dir, "runs")
			qemu := filepath.Join(dir, "qemu")
			script := "#!/bin/sh\necho x >> " + count + "\necho '" + tc.console + "'\n"
			if err := os.WriteFile(qemu, []byte(script), 0o755); err != nil {
				t.Fatal(err)
			}
			kernel := filepath.Join(dir, "bzImage")
			if err := os.WriteFile(kernel, nil, 0o644); err != nil {
				t.Fatal(err)
			}
			var out strings.Builder
			res, err := Run(context.Background(), Config{Kernel: kernel, QEMU: qemu, Busybox: bb, Cmd: "true", Output: &out})
			if err == nil || res.Started {
				t.Fatalf("Run: %v (started %v)", err, res.Started)
			}
			b, err := os.ReadFile(count)
			if err != nil {
				t.Fatal(err)
			}
			if n := strings.Count(string(b), "x"); n != tc.want {
				t.Fatalf("qemu ran %d times, want %d (output %q)", n, tc.want, out.String())
			}
			if tc.want > 1 && strings.Count(out.String(), "booting again") != tc.want-1 {
				t.Errorf("output %q: want %s lines saying it boots again", out.String(), strconv.Itoa(tc.want-1))
			}
		})
	}
}
