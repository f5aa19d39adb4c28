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
	"time"
)

func TestParseArgs(t *testing.T) {
	o, err := parseArgs([]string{"--namespace", "mpnbd", "--endpoint", "tcp://127.0.0.1:0"})
	if err != nil || o.namespace != "mpnbd" || o.waitTimeout <= 0 || !o.sign || o.replicaLostAfter != 10*time.Minute ||
		o.nodeAccount != "mpnbd:mpnbd-node" || o.storageAccount != "mpnbd:mpnbd-storage-agent" || o.defaultEncryption != "none" {
		t.Fatalf("parseArgs = %+v, %v", o, err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{}, "--namespace"},
		{[]string{"--namespace", "x", "--endpoint", "csi.sock"}, "--endpoint"},
		{[]string{"--namespace", "x", "--log-format", "xml"}, "--log-format"},
		{[]string{"--namespace", "x", "--wait-timeout", "0s"}, "--wait-timeout"},
		{[]string{"--namespace", "x", "--replica-lost-after", "0s"}, "--replica-lost-after"},
		{[]string{"--namespace", "x", "extra"}, "extra"},
		{[]string{"--namespace", "x", "--default-encryption", "always"}, "--default-encryption"},
		{[]string{"--namespace", "x", "--node-service-account", "mpnbd-node"}, "--node-service-account"},
		{[]string{"--namespace", "x", "--storage-service-account", "Bad:agent"}, "--storage-service-account"},
	} {
		t.Setenv("POD_NAMESPACE", "")
		if _, err := parseArgs(c.args); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("parseArgs(%q) = %v, want an error naming %s", c.args, err, c.want)
		}
	}
}

func TestRunUsage(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"--help"}, &out, &errb); code != 0 || !strings.Contains(out.String(), "-wait-timeout") {
		t.Fatalf("--help: code %d, output %q", code, out.String())
	}
	t.Setenv("POD_NAMESPACE", "")
	if code := run(context.Background(), nil, &out, &errb); code != 2 || !strings.Contains(errb.String(), "--namespace") {
		t.Fatalf("no namespace: code %d, stderr %q", code, errb.String())
	}
}
