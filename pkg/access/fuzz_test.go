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
