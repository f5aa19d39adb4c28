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
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/buildinfo"
)

func TestParseArgs(t *testing.T) {
	tests := []struct {
		args    []string
		want    options // compared when wantErr is ""
		wantErr string
	}{
		{nil, options{output: "table", timeout: 5 * time.Second, wait: time.Hour, command: "volumes"}, ""},
		{[]string{"volumes", "-o", "json"}, options{output: "json", timeout: 5 * time.Second, wait: time.Hour, command: "volumes"}, ""},
		// Flags before, between and after the command and its NAME.
		{[]string{"--kubeconfig", "/k", "volume", "--timeout", "2s", "pvc-1", "--output", "json", "--metrics-port", "9811"},
			options{kubeconfig: "/k", output: "json", metricsPort: 9811, timeout: 2 * time.Second, wait: time.Hour, command: "volume", volume: "pvc-1"}, ""},
		{[]string{"volume", "default/data", "--metrics-url", "n1=http://10.0.0.1:9811", "--metrics-url", "n2=https://h/x/metrics"},
			options{output: "table", timeout: 5 * time.Second, wait: time.Hour, command: "volume", volume: "default/data",
				metricsURLs: map[string]string{"n1": "http://10.0.0.1:9811/metrics", "n2": "https://h/x/metrics"}}, ""},
		{[]string{"-n", "mpnbd-system", "volumes"}, options{output: "table", namespace: "mpnbd-system", timeout: 5 * time.Second, wait: time.Hour, command: "volumes"}, ""},
		{[]string{"volume", "pvc-1", "--namespace", "kube-system"}, options{output: "table", namespace: "kube-system", timeout: 5 * time.Second, wait: time.Hour, command: "volume", volume: "pvc-1"}, ""},
		{[]string{"drain", "s1", "--wait", "10m"}, options{output: "table", timeout: 5 * time.Second, wait: 10 * time.Minute, command: "drain", node: "s1"}, ""},
		{[]string{"cordon", "s1"}, options{output: "table", timeout: 5 * time.Second, wait: time.Hour, command: "cordon", node: "s1"}, ""},
		{[]string{"version", "-o", "json"}, options{output: "json", timeout: 5 * time.Second, wait: time.Hour, command: "version"}, ""},
		{[]string{"version", "x"}, options{}, `unexpected argument "x"`},
		{[]string{"storage-nodes", "-o", "json"}, options{output: "json", timeout: 5 * time.Second, wait: time.Hour, command: "storage-nodes"}, ""},
		{[]string{"--storage-node", "s1", "--node", "n1", "--unhealthy"},
			options{output: "table", timeout: 5 * time.Second, wait: time.Hour, command: "volumes", storageNode: "s1", publishedTo: "n1", unhealthy: true}, ""},
		{[]string{"volume", "pvc-1", "--unhealthy"}, options{}, "--storage-node, --node and --unhealthy filter volumes, not volume"},
		{[]string{"storage-nodes", "--node", "n1"}, options{}, "filter volumes, not storage-nodes"},
		{[]string{"uncordon"}, options{}, "uncordon: want one NODE"},
		{[]string{"drain", "s1", "--wait", "-1s"}, options{}, "--wait must not be negative"},
		{[]string{"volume"}, options{}, "want one NAME"},
		{[]string{"volume", "a", "b"}, options{}, "want one NAME"},
		{[]string{"volumes", "a"}, options{}, `unexpected argument "a"`},
		{[]string{"nodes"}, options{}, `unknown command "nodes"`},
		{[]string{"-o", "yaml"}, options{}, `--output "yaml"`},
		{[]string{"--metrics-port", "70000"}, options{}, "--metrics-port 70000"},
		{[]string{"--timeout", "0s"}, options{}, "--timeout"},
		{[]string{"--metrics-url", "n1"}, options{}, "want NODE=URL"},
		{[]string{"--metrics-url", "=http://h"}, options{}, "want NODE=URL"},
		{[]string{"--metrics-url", "n1=10.0.0.1:9811"}, options{}, "want an http:// or https:// URL"},
		{[]string{"--metrics-url", "n1=http://a", "--metrics-url", "n1=http://b"}, options{}, "node n1 given twice"},
		{[]string{"--no-such-flag"}, options{}, "no-such-flag"},
		// support-bundle: -o names its file, by default one it names
		// when it runs.
		{[]string{"support-bundle", "-n", "mpnbd-system"},
			options{output: "", namespace: "mpnbd-system", timeout: 5 * time.Second, wait: time.Hour, command: "support-bundle"}, ""},
		{[]string{"support-bundle", "-o", "-", "--since", "1h", "--log-bytes", "4096"},
			options{output: "-", timeout: 5 * time.Second, wait: time.Hour, since: time.Hour, logBytes: 4096, command: "support-bundle"}, ""},
		{[]string{"--output", "b.tar.gz", "support-bundle", "--since", "0s"},
			options{output: "b.tar.gz", timeout: 5 * time.Second, wait: time.Hour, logBytes: defaultLogBytes, command: "support-bundle"}, ""},
		{[]string{"support-bundle", "-o", "json"}, options{}, `support-bundle: --output "json": it names the archive's file`},
		{[]string{"support-bundle", "x"}, options{}, `unexpected argument "x"`},
		{[]string{"support-bundle", "--log-bytes", "0"}, options{}, "--log-bytes must be positive"},
		{[]string{"support-bundle", "--since", "-1h"}, options{}, "--since must not be negative"},
		{[]string{"support-bundle", "--unhealthy"}, options{}, "filter volumes, not support-bundle"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			o, err := parseArgs(tc.args)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			// The support-bundle flags' defaults, unless the case sets
			// them.
			if tc.want.since == 0 && tc.want.logBytes == 0 {
				tc.want.since, tc.want.logBytes = defaultLogSince, defaultLogBytes
			}
			if !reflect.DeepEqual(*o, tc.want) {
				t.Errorf("options %+v, want %+v", *o, tc.want)
			}
		})
	}
}

func TestRunExitCodes(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	tests := []struct {
		args       []string
		code       int
		stdout     string
		stderr     string
		kubeconfig string // $KUBECONFIG
	}{
		{[]string{"--help"}, 0, "get on pods/proxy", "", ""},
		{[]string{"-o", "xml"}, 2, "", "mpnbdctl: --output \"xml\" (want table or json)\nRun 'mpnbdctl --help' for usage.\n", ""},
		{[]string{"volume"}, 2, "", "want one NAME", ""},
		{[]string{"--kubeconfig", missing}, 1, "", "mpnbdctl: kubeconfig " + missing, ""},
		{nil, 1, "", "mpnbdctl: no API server configuration", missing},
		// version says its own first.
		{[]string{"version"}, 1, "mpnbdctl " + buildinfo.Version + " (revision ", "mpnbdctl: no API server configuration", missing},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			t.Setenv("KUBECONFIG", tc.kubeconfig)
			t.Setenv("KUBERNETES_SERVICE_HOST", "")
			t.Setenv("HOME", t.TempDir())
			var out, errb bytes.Buffer
			code := run(context.Background(), tc.args, &out, &errb)
			if code != tc.code || !strings.Contains(out.String(), tc.stdout) || !strings.Contains(errb.String(), tc.stderr) {
				t.Errorf("code %d, stdout %q, stderr %q; want %d, %q, %q", code, out.String(), errb.String(), tc.code, tc.stdout, tc.stderr)
			}
		})
	}
}
