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

package sidecar

import (
	"io"
	"log/slog"
	"testing"
)

func TestManifestArgs(t *testing.T) {
	all, err := ManifestArgs("deploy/node.yaml", "node-driver-registrar")
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 1 || len(all[0]) == 0 || all[0][0] != "--csi-address=/csi/csi.sock" {
		t.Errorf("args %q", all)
	}
	if _, err := ManifestArgs("deploy/node.yaml", "no-such-container"); err == nil {
		t.Error("missing container found")
	}
}

func TestParseRejects(t *testing.T) {
	fs := NewFlagSet("x", io.Discard)
	fs.String("a", "", "")
	if err := Parse(fs, []string{"--a=1", "--b=2"}); err == nil {
		t.Error("unknown flag accepted")
	}
	fs = NewFlagSet("x", io.Discard)
	if err := Parse(fs, []string{"pos"}); err == nil {
		t.Error("positional argument accepted")
	}
}

func TestTargetAndLevel(t *testing.T) {
	if Target("/csi/csi.sock") != "unix:/csi/csi.sock" || Target("unix:///csi/csi.sock") != "unix:///csi/csi.sock" {
		t.Error("target")
	}
	if Level(2) != slog.LevelInfo || Level(4) != slog.LevelDebug || Level(5) != slog.LevelDebug {
		t.Error("level")
	}
}
