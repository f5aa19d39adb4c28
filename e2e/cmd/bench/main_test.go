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
	"strings"
	"testing"
)

func TestList(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"--list"}, []string{"servers ours,ours-tls,nbdkit,nbd-server", "networks tcp1,mptcp4,asym,asym-backup,asym-auto", "140 runs x 3 repeats"}},
		{[]string{"--list", "--quick", "--servers", "ours", "--networks", "mptcp4"}, []string{"8 runs x 1 repeats of 3s"}},
		{[]string{"--list", "--profile", "demo"}, []string{"servers ours;", "networks tcp1,mptcp4;", "clients ours;", "workloads seqread,seqwrite", "4 runs x 1 repeats of 5s"}},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), tc.args, &stdout, &stderr); code != 0 {
			t.Fatalf("%v: exit %d: %s", tc.args, code, stderr.String())
		}
		for _, w := range tc.want {
			if !strings.Contains(stderr.String(), w) {
				t.Errorf("%v: output lacks %q:\n%s", tc.args, w, stderr.String())
			}
		}
	}
}

func TestUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		{"--profile", "nope"},
		{"--servers", "qemu"},
		{"--workloads", "mixed", "--list"},
		{"--repeat", "0", "--list"},
		{"--servers", "ours,ours-b", "--list"},
		{"--bogus"},
		{"--profile", "many", "--stale-loss-count", "-1"},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), args, &stdout, &stderr); code != 2 {
			t.Errorf("%v: exit %d, want 2", args, code)
		}
	}
}
