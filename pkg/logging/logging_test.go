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

package logging

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
)

func TestNewFormats(t *testing.T) {
	var b bytes.Buffer
	New(&b, slog.LevelInfo, FormatJSON).Info("attached", "volume_id", "pv-1")
	var m map[string]any
	if err := json.Unmarshal(b.Bytes(), &m); err != nil || m["volume_id"] != "pv-1" || m["msg"] != "attached" {
		t.Fatalf("json line %q: %v %v", b.String(), m, err)
	}
	b.Reset()
	log := New(&b, slog.LevelWarn, FormatText)
	log.Info("hidden")
	log.Warn("shown", "error", "boom")
	if got := b.String(); strings.Contains(got, "hidden") || !strings.Contains(got, "msg=shown error=boom") {
		t.Fatalf("text at warn: %q", got)
	}
	if CheckFormat("yaml") == nil || CheckFormat(FormatJSON) != nil || CheckFormat(FormatText) != nil {
		t.Fatal("CheckFormat")
	}
}

// TestFromEnvFollowsSetup: a process started after Setup logs in the
// format and at the level of the one that started it.
func TestFromEnvFollowsSetup(t *testing.T) {
	t.Setenv(EnvFormat, "")
	t.Setenv(EnvLevel, "")
	old := slog.Default()
	defer slog.SetDefault(old)
	Setup(New(&bytes.Buffer{}, slog.LevelDebug, FormatJSON), slog.LevelDebug, FormatJSON)
	var b bytes.Buffer
	child := FromEnv(&b)
	child.Debug("queue started", "volume_id", "pv-2")
	var m map[string]any
	if err := json.Unmarshal(b.Bytes(), &m); err != nil || m["level"] != "DEBUG" || m["volume_id"] != "pv-2" {
		t.Fatalf("a child's debug line %q: %v", b.String(), err)
	}
	t.Setenv(EnvLevel, "nonsense")
	b.Reset()
	FromEnv(&b).Debug("dropped")
	if b.Len() != 0 {
		t.Fatalf("an unreadable level logs debug: %q", b.String())
	}
}
