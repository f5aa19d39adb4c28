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

package sbom

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"strings"
	"testing"
	"time"
)

const status = `Package: e2fsprogs
Status: install ok installed
Priority: required
Architecture: arm64
Version: 1.47.0-2
Description: ext2/ext3/ext4 file system utilities
 The ext2, ext3 and ext4 file systems are successors of the original ext
 file system.

Package: libgcc-s1
Status: install ok installed
Architecture: arm64
Source: gcc-12
Version: 12.2.0-14

Package: removed-one
Status: deinstall ok config-files
Architecture: arm64
Version: 1.0

Package: systemd
Status: install ok installed
Architecture: arm64
Version: 1:252.30-1~deb12u2
`

// fakeImage lays out a root file system with this test's own binary (a Go
// program with build information) as a driver command, a shell script
// beside it, and Debian's package database.
func fakeImage(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	bin := filepath.Join(root, "usr", "local", "bin")
	must(t, os.MkdirAll(bin, 0o755))
	self, err := os.Executable()
	must(t, err)
	data, err := os.ReadFile(self)
	must(t, err)
	must(t, os.WriteFile(filepath.Join(bin, "node"), data, 0o755))
	must(t, os.WriteFile(filepath.Join(bin, "helper.sh"), []byte("#!/bin/sh\n"), 0o755))
	must(t, os.MkdirAll(filepath.Join(root, "var", "lib", "dpkg"), 0o755))
	must(t, os.WriteFile(filepath.Join(root, dpkgStatus), []byte(status), 0o644))
	must(t, os.MkdirAll(filepath.Join(root, "etc"), 0o755))
	must(t, os.WriteFile(filepath.Join(root, "etc", "os-release"), []byte("ID=debian\nVERSION_ID=\"12\"\n"), 0o644))
	return root
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestGenerate(t *testing.T) {
	root := fakeImage(t)
	im := Image{Name: "ghcr.io/mpnbd/mpnbd", Version: "1.2.3", Arch: "arm64", Created: time.Unix(1e9, 0)}
	doc, err := Generate(root, im)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	must(t, doc.Write(&buf))
	// What a consumer reads back: the JSON, not the Go values.
	var got Document
	must(t, json.Unmarshal(buf.Bytes(), &got))
	if got.SPDXVersion != "SPDX-2.3" || got.DataLicense != "CC0-1.0" || got.SPDXID != "SPDXRef-DOCUMENT" {
		t.Errorf("header: %+v", got)
	}
	if !strings.HasPrefix(got.DocumentNamespace, "https://") || got.CreationInfo.Created != "2001-09-09T01:46:40Z" {
		t.Errorf("namespace %q, created %q", got.DocumentNamespace, got.CreationInfo.Created)
	}

	valid := regexp.MustCompile(`^SPDXRef-[A-Za-z0-9.-]+$`)
	byID := map[string]Package{}
	purls := map[string]string{}
	for _, p := range got.Packages {
		if !valid.MatchString(p.SPDXID) {
			t.Errorf("package %s: identifier %q is not a valid SPDX id", p.Name, p.SPDXID)
		}
		if _, dup := byID[p.SPDXID]; dup {
			t.Errorf("identifier %s used twice", p.SPDXID)
		}
		byID[p.SPDXID] = p
		for _, r := range p.ExternalRefs {
			purls[r.Locator] = p.SPDXID
		}
	}
	for _, r := range got.Relationships {
		for _, id := range []string{r.Element, r.Related} {
			if _, ok := byID[id]; !ok && id != "SPDXRef-DOCUMENT" {
				t.Errorf("relationship %+v names %s, which is no package", r, id)
			}
		}
	}

	// Every module this binary links is in the document, at its version
	// (a test binary of this package links none but the main module: the
	// release test checks the driver's programs, which link many).
	info, ok := debug.ReadBuildInfo()
	if !ok {
		t.Fatal("no build information in the test binary")
	}
	if _, ok := purls["pkg:golang/"+info.Main.Path+"@1.2.3"]; !ok {
		t.Errorf("no package for the main module %s at the image's version 1.2.3", info.Main.Path)
	}
	for _, m := range info.Deps {
		if m.Replace != nil {
			m = m.Replace
		}
		want := "pkg:golang/" + m.Path + "@" + m.Version
		if _, ok := purls[want]; !ok {
			t.Errorf("module %s@%s: no package with purl %s", m.Path, m.Version, want)
		}
	}
	if _, ok := purls["pkg:golang/stdlib@"+info.GoVersion]; !ok {
		t.Errorf("no package for the Go toolchain %s", info.GoVersion)
	}
	// The program's file, with its digest; the script is no Go program.
	var prog *Package
	for _, p := range got.Packages {
		if p.Name == "/usr/local/bin/node" {
			prog = &p
		}
		if strings.Contains(p.Name, "helper.sh") {
			t.Errorf("a shell script was taken for a Go program: %+v", p)
		}
	}
	if prog == nil || len(prog.Checksums) != 1 || len(prog.Checksums[0].Value) != 64 {
		t.Fatalf("the program's package: %+v", prog)
	}

	// Debian's installed packages only, epoch escaped, source named.
	for _, want := range []string{
		"pkg:deb/debian/e2fsprogs@1.47.0-2?arch=arm64&distro=debian-12",
		"pkg:deb/debian/libgcc-s1@12.2.0-14?arch=arm64&distro=debian-12&upstream=gcc-12",
		"pkg:deb/debian/systemd@1:252.30-1~deb12u2?arch=arm64&distro=debian-12",
	} {
		if _, ok := purls[want]; !ok {
			t.Errorf("no package with purl %s; have %v", want, keys(purls))
		}
	}
	for l := range purls {
		if strings.Contains(l, "removed-one") {
			t.Errorf("a package that is not installed is listed: %s", l)
		}
	}

	// The same image gives the same namespace; another image another.
	again, err := Generate(root, im)
	must(t, err)
	if again.DocumentNamespace != got.DocumentNamespace {
		t.Errorf("namespace changed between two runs over one image: %s, %s", got.DocumentNamespace, again.DocumentNamespace)
	}
	im.Arch = "amd64"
	other, err := Generate(root, im)
	must(t, err)
	if other.DocumentNamespace == got.DocumentNamespace {
		t.Errorf("two architectures share the namespace %s", got.DocumentNamespace)
	}
}

func TestGenerateRefusesAnEmptyImage(t *testing.T) {
	root := fakeImage(t)
	must(t, os.Remove(filepath.Join(root, "usr", "local", "bin", "node")))
	if _, err := Generate(root, Image{Name: "x", Version: "1", Arch: "amd64"}); err == nil || !strings.Contains(err.Error(), "no Go program") {
		t.Errorf("an image without Go programs: %v", err)
	}
	root = fakeImage(t)
	must(t, os.Remove(filepath.Join(root, dpkgStatus)))
	if _, err := Generate(root, Image{Name: "x", Version: "1", Arch: "amd64"}); err == nil || !strings.Contains(err.Error(), "no installed package") {
		t.Errorf("an image without a package database: %v", err)
	}
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}
