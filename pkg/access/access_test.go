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

package access

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/validation"
)

func TestTokenRoundTrip(t *testing.T) {
	tok, err := NewToken()
	if err != nil {
		t.Fatal(err)
	}
	other, _ := NewToken()
	if tok == other {
		t.Fatalf("two tokens are equal: %s", tok)
	}
	if !ValidToken(tok) {
		t.Fatalf("NewToken made an invalid token %q", tok)
	}
	name := NodeExport("pvc-1", tok)
	vol, got, ok := SplitExport(name)
	if !ok || vol != "pvc-1" || got != tok {
		t.Fatalf("SplitExport(%q) = %q, %q, %v", name, vol, got, ok)
	}
	if !TokenEqual(got, tok) || TokenEqual(got, other) {
		t.Fatal("TokenEqual is wrong")
	}
}

func TestSplitExportRejects(t *testing.T) {
	tok, _ := NewToken()
	for _, name := range []string{
		"", "pvc-1", "pvc-1/", "/" + tok, "pvc-1/" + tok[:31], "pvc-1/" + tok + "0",
		"pvc-1/" + strings.ToUpper(tok[:31]) + "g", "pvc-1/" + tok + "/x",
	} {
		if v, tk, ok := SplitExport(name); ok {
			t.Errorf("SplitExport(%q) = %q, %q, true; want refusal", name, v, tk)
		}
	}
}

func TestSecretName(t *testing.T) {
	a := SecretName("pvc-1", "node-a")
	b := SecretName("pvc-1", "node-b")
	c := SecretName("pvc-1node-a", "")
	if a == b || a == c || a != SecretName("pvc-1", "node-a") {
		t.Fatalf("secret names not distinct or not stable: %s %s %s", a, b, c)
	}
	for _, n := range []string{a, SecretName(strings.Repeat("x", 300), "Node_With.Odd/Chars")} {
		if errs := validation.IsDNS1123Subdomain(n); len(errs) > 0 {
			t.Errorf("%q is not a valid object name: %v", n, errs)
		}
	}
}

func TestParseTopology(t *testing.T) {
	m, err := ParseTopology("")
	if err != nil || len(m) != 1 || m[TopologyKey] != DefaultTopology {
		t.Fatalf("default topology = %v, %v", m, err)
	}
	m, err = ParseTopology("topology.mpnbd.io/zone=a, rack=r1")
	if err != nil || len(m) != 2 || m["topology.mpnbd.io/zone"] != "a" || m["rack"] != "r1" {
		t.Fatalf("ParseTopology = %v, %v", m, err)
	}
	for _, bad := range []string{"zone", "=a", "zone=a,zone=b", "bad key=a", "zone=not a value", "zone=" + strings.Repeat("x", 64)} {
		if _, err := ParseTopology(bad); err == nil {
			t.Errorf("ParseTopology(%q) succeeds", bad)
		}
	}
}

func TestLoadOrCreateToken(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state", "token")
	tok, err := LoadOrCreateToken(path)
	if err != nil || !ValidToken(tok) {
		t.Fatalf("LoadOrCreateToken = %q, %v", tok, err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("token file %v, %v; want mode 0600", fi, err)
	}
	if again, err := LoadOrCreateToken(path); err != nil || again != tok {
		t.Fatalf("second load = %q, %v; want the same token", again, err)
	}
	if err := os.WriteFile(path, []byte("not a token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreateToken(path); err == nil {
		t.Fatal("a damaged token file was taken")
	}
}

func TestExportNameRoundTrip(t *testing.T) {
	tok, _ := NewToken()
	for _, tc := range []struct {
		volume, token string
		epoch         int64
		want          string
	}{
		{"pvc-1", tok, 7, "pvc-1/" + tok + "@7"},
		{"pvc-1", "", 12, "pvc-1@12"},
		{"pvc-1", tok, 0, "pvc-1/" + tok},
		{"pvc-1", "", 0, "pvc-1"},
	} {
		name := ExportName(tc.volume, tc.token, tc.epoch)
		if name != tc.want {
			t.Errorf("ExportName(%q, %q, %d) = %q, want %q", tc.volume, tc.token, tc.epoch, name, tc.want)
		}
		v, tk, e, ok := ParseExport(name)
		if !ok || v != tc.volume || tk != tc.token || e != tc.epoch {
			t.Errorf("ParseExport(%q) = %q, %q, %d, %v", name, v, tk, e, ok)
		}
	}
	for _, name := range []string{"", "@3", "pvc-1@", "pvc-1@0", "pvc-1@-2", "pvc-1@03", "pvc-1@x", "pvc-1/short@3", "pvc-1/" + tok + "@3@4"} {
		if v, tk, e, ok := ParseExport(name); ok {
			t.Errorf("ParseExport(%q) = %q, %q, %d, true; want refusal", name, v, tk, e)
		}
	}
}
