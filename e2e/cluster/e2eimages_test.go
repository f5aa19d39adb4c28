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

package cluster

import (
	"archive/tar"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// TestE2EImages builds the storage suites' images (a static busybox
// standing in for agnhost) and reads them back: their names, entrypoints,
// and files.
func TestE2EImages(t *testing.T) {
	if _, err := os.Stat(DebianBusybox); err != nil {
		t.Skipf("no busybox-static (%v)", err)
	}
	dir := t.TempDir()
	images, err := E2EImages(DebianBusybox, dir)
	if err != nil {
		t.Fatal(err)
	}
	var refs []string
	for _, im := range images {
		refs = append(refs, im.Ref)
	}
	want := []string{
		"registry.k8s.io/e2e-test-images/busybox:1.37.0-1",
		"registry.k8s.io/e2e-test-images/nginx:1.14-4",
		"registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7",
		"registry.k8s.io/e2e-test-images/agnhost:2.56",
	}
	if !slices.Equal(refs, want) {
		t.Fatalf("images %q, want %q", refs, want)
	}
	for i, im := range images {
		out := filepath.Join(dir, "image.tar")
		if err := im.Build(out); err != nil {
			t.Fatalf("%s: %v", im.Ref, err)
		}
		tag, err := name.NewTag(im.Ref)
		if err != nil {
			t.Fatal(err)
		}
		img, err := tarball.ImageFromPath(out, &tag)
		if err != nil {
			t.Fatalf("%s: %v", im.Ref, err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		entry := []string{"/bin/sh"}
		if i == 3 {
			entry = []string{"/agnhost"}
		}
		if !slices.Equal(cf.Config.Entrypoint, entry) {
			t.Errorf("%s: entrypoint %q, want %q", im.Ref, cf.Config.Entrypoint, entry)
		}
		files := map[string]*tar.Header{}
		rc := mutate.Extract(img)
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			files["/"+strings.TrimSuffix(h.Name, "/")] = h
		}
		rc.Close()
		for _, l := range []string{"/bin/sh", "/bin/ls", "/bin/mount", "/usr/bin/md5sum", "/bin/dd", "/usr/bin/find", "/bin/sync"} {
			if h := files[l]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "/bin/busybox" {
				if (l == "/bin/dd" || l == "/bin/sh") && im.Ref == E2EJessieDnsutilsRef {
					continue
				}
				t.Errorf("%s: %s is not a link to /bin/busybox: %+v", im.Ref, l, h)
			}
		}
		if im.Ref == E2EJessieDnsutilsRef {
			// GNU dd (oflag=nocache) and dash (which runs it: busybox's
			// shell would run its own dd), over busybox's, and their
			// loader.
			for _, p := range []string{"/bin/dd", "/bin/sh"} {
				if h := files[p]; h == nil || h.Typeflag != tar.TypeReg || h.Mode&0o111 == 0 {
					t.Errorf("%s: %s is not Debian's: %+v", im.Ref, p, h)
				}
			}
			if h := files["/lib64/ld-linux-x86-64.so.2"]; h == nil {
				t.Errorf("%s: no dynamic loader for GNU dd", im.Ref)
			}
		}
		if h := files["/bin/busybox"]; h == nil || h.Typeflag != tar.TypeReg || h.Mode&0o111 == 0 {
			t.Errorf("%s: no executable /bin/busybox: %+v", im.Ref, h)
		}
		if h := files["/tmp"]; h == nil || h.Mode&0o1777 != 0o1777 {
			t.Errorf("%s: no world-writable /tmp: %+v", im.Ref, h)
		}
		if h := files["/agnhost"]; (h != nil) != (i == 3) {
			t.Errorf("%s: /agnhost %+v", im.Ref, h)
		}
	}

	// A program that needs a dynamic loader cannot run in these images.
	if err := checkStatic("/bin/ls"); err == nil || !strings.Contains(err.Error(), "dynamically linked") {
		t.Skipf("no dynamically linked /bin/ls here (%v)", err)
	}
	if _, err := E2EImages("/bin/ls", dir); err == nil || !strings.Contains(err.Error(), "dynamically linked") {
		t.Errorf("E2EImages with a dynamic agnhost: %v, want a refusal", err)
	}
}
