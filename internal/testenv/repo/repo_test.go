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

package repo

import (
	"os"
	"path/filepath"
	"testing"
)

func TestDeclares(t *testing.T) {
	for _, c := range []struct {
		gomod string
		want  bool
	}{
		{"module github.com/mpnbd/mpnbd\n\ngo 1.26.0\n", true},
		{"// comment\nmodule \"github.com/mpnbd/mpnbd\"\r\n", true},
		{"module github.com/mpnbd/mpnbd", true},
		{"module github.com/mpnbd/mpnbd/e2e\n\ngo 1.26.0\n", false},
		{"module example.com/github.com/mpnbd/mpnbd\n", false},
		{"require github.com/mpnbd/mpnbd v0.0.0\n", false},
	} {
		if got := declares([]byte(c.gomod), Module); got != c.want {
			t.Errorf("declares(%q) = %v, want %v", c.gomod, got, c.want)
		}
	}
}

// TestRootFromE2E checks that Root finds the driver's module, not the e2e
// module, from inside e2e/.
func TestRootFromE2E(t *testing.T) {
	root, err := Root()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "internal", "testenv", "repo", "repo.go")); err != nil {
		t.Fatalf("Root() = %s: %v", root, err)
	}
	e2e := filepath.Join(root, "e2e")
	if _, err := os.Stat(filepath.Join(e2e, "go.mod")); err != nil {
		t.Skipf("no e2e module: %v", err)
	}
	t.Chdir(e2e)
	got, err := Root()
	if err != nil {
		t.Fatal(err)
	}
	if got != root {
		t.Errorf("Root() from %s = %s, want %s", e2e, got, root)
	}
}
