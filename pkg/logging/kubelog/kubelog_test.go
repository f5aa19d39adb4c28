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

package kubelog

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"

	"k8s.io/klog/v2"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
)

func TestBridge(t *testing.T) {
	var b bytes.Buffer
	Bridge(slog.New(slog.NewJSONHandler(&b, nil)))
	defer klog.ClearLogger()
	klog.InfoS("from client-go", "node", "n1")
	ctrllog.Log.WithName("agent").Info("from controller-runtime", "volume_id", "pv-1")
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("%d lines through the handler, want 2: %q", len(lines), b.String())
	}
	for i, want := range []map[string]string{{"msg": "from client-go", "node": "n1"}, {"msg": "from controller-runtime", "volume_id": "pv-1"}} {
		var m map[string]any
		if err := json.Unmarshal([]byte(lines[i]), &m); err != nil {
			t.Fatalf("line %d %q: %v", i, lines[i], err)
		}
		for k, v := range want {
			if m[k] != v {
				t.Errorf("line %d: %s=%v, want %q (%q)", i, k, m[k], v, lines[i])
			}
		}
	}
}
