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

import "testing"

// FuzzParseExport: the storage agent parses every export name a client
// sends. Whatever it accepts, ExportName makes again, byte for byte.
func FuzzParseExport(f *testing.F) {
	for _, s := range []string{"pvc-1", "pvc-1@3", "pvc-1/00112233445566778899aabbccddeeff@12", "pvc-1/x@", "@", "a/b/c@-1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		v, tok, e, ok := ParseExport(name)
		if !ok {
			return
		}
		if got := ExportName(v, tok, e); got != name {
			t.Fatalf("ParseExport(%q) = %q, %q, %d; ExportName gives %q", name, v, tok, e, got)
		}
	})
}
