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
	"bufio"
	"bytes"
	"debug/elf"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
)

// The images Kubernetes' storage e2e suites (External.Storage) run, under
// the names k8s.io/kubernetes test/utils/image/manifest.go gives them at
// v1.34.4 (hack/kube-e2e.sh pins that version), so that a node which pulls
// nothing has them.
const (
	// E2EBusyboxRef is the suites' default test image (writer, reader and
	// volume client pods).
	E2EBusyboxRef = "registry.k8s.io/e2e-test-images/busybox:1.37.0-1"
	// E2EAgnhostRef runs the subPath suite's containers.
	E2EAgnhostRef = "registry.k8s.io/e2e-test-images/agnhost:2.56"
	// E2ENginxRef runs the volumes suite's exec check, a /bin/sh script.
	E2ENginxRef = "registry.k8s.io/e2e-test-images/nginx:1.14-4"
	// E2EJessieDnsutilsRef runs the multi-volume suite's concurrent
	// access pods, which run the same shell commands as busybox pods but
	// for dd's oflag=nocache, which only GNU dd knows (the real image is
	// Debian's).
	E2EJessieDnsutilsRef = "registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7"

	// GNUDd is Debian's coreutils dd, which the jessie-dnsutils stand-in
	// holds as /bin/dd, with the libraries it links; and DebianDash its
	// /bin/sh, as the real image has it: busybox's shell runs its own
	// applets before any program of the PATH, dd included.
	GNUDd      = "/usr/bin/dd"
	DebianDash = "/bin/dash"

	// DebianBusybox is Debian's busybox-static.
	DebianBusybox = "/bin/busybox"
)

// E2EImages describes the images of the storage suites, made from
// agnhost (a static build of k8s.io/kubernetes/test/images/agnhost:
// hack/kube-e2e.sh) and Debian's static busybox, whose layer (busybox as
// /bin/busybox and a symbolic link to it for every applet, where
// `busybox --install -s` puts them) it writes to dir. The busybox, nginx
// and jessie-dnsutils images are that layer with /bin/sh as entrypoint
// (jessie-dnsutils with GNU dd and dash over busybox's, as the real one
// has them):
// the suites give those containers a command, or none, which the real
// images' CMD ["sh"] runs as well. The agnhost image adds /agnhost, its
// entrypoint, to the same layer: the suites exec /bin/sh in its
// containers too, as the real one (alpine-based) allows.
func E2EImages(agnhost, dir string) ([]Image, error) {
	return e2eImages(agnhost, DebianBusybox, dir)
}

func e2eImages(agnhost, busybox, dir string) ([]Image, error) {
	for _, p := range []string{agnhost, busybox} {
		if err := checkStatic(p); err != nil {
			return nil, err
		}
	}
	layer := filepath.Join(dir, "e2e-busybox-layer.tar")
	if err := writeBusyboxLayer(busybox, layer); err != nil {
		return nil, err
	}
	base := []string{layer}
	sh := []string{"/bin/sh"}
	dd, err := withLibraries(GNUDd, "/bin/dd")
	if err != nil {
		return nil, err
	}
	dash, err := withLibraries(DebianDash, "/bin/sh")
	if err != nil {
		return nil, err
	}
	maps.Copy(dd, dash)
	return []Image{
		{Ref: E2EBusyboxRef, BaseLayers: base, Entrypoint: sh},
		{Ref: E2ENginxRef, BaseLayers: base, Entrypoint: sh},
		{Ref: E2EJessieDnsutilsRef, BaseLayers: base, Files: dd, Entrypoint: sh},
		{Ref: E2EAgnhostRef, BaseLayers: base, Files: map[string]string{"/agnhost": agnhost}, Entrypoint: []string{"/agnhost"}},
	}, nil
}

// withLibraries is an image's files for the dynamically linked program
// prog, put at at: the program and every library and loader it links
// (as ldd lists them), each at its own path.
func withLibraries(prog, at string) (map[string]string, error) {
	out, err := exec.Command("ldd", prog).Output()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w", prog, err)
	}
	files := map[string]string{at: prog}
	for _, line := range strings.Split(string(out), "\n") {
		// "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
		// "/lib64/ld-linux-x86-64.so.2 (0x...)"; the vDSO has no file.
		f := strings.Fields(line)
		for i, w := range f {
			if strings.HasPrefix(w, "/") && (i == 0 || f[i-1] == "=>") {
				files[w] = w
			}
		}
	}
	if len(files) == 1 {
		return nil, fmt.Errorf("ldd %s lists no library: %s", prog, out)
	}
	return files, nil
}

// checkStatic refuses a program that needs a dynamic loader: an image of
// one file and links has none.
func checkStatic(p string) error {
	f, err := elf.Open(p)
	if err != nil {
		return fmt.Errorf("image program %s: %w", p, err)
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return fmt.Errorf("image program %s is dynamically linked; it needs a static build", p)
		}
	}
	return nil
}

// busyboxApplets lists where `busybox --install -s` links each applet,
// as absolute paths.
func busyboxApplets(busybox string) ([]string, error) {
	out, err := exec.Command(busybox, "--list-full").Output()
	if err != nil {
		return nil, fmt.Errorf("%s --list-full: %w", busybox, err)
	}
	var links []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if l == "" {
			continue
		}
		l = path.Clean("/" + l)
		if l != "/bin/busybox" {
			links = append(links, l)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if !slices.Contains(links, "/bin/sh") {
		return nil, fmt.Errorf("%s has no sh applet", busybox)
	}
	slices.Sort(links)
	return slices.Compact(links), nil
}

// writeBusyboxLayer writes a layer of busybox at /bin/busybox, a link to
// it for every applet, the users root and nobody, and /tmp.
func writeBusyboxLayer(busybox, out string) error {
	links, err := busyboxApplets(busybox)
	if err != nil {
		return err
	}
	bin, err := os.ReadFile(busybox)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	var addDir func(d string, mode int64) error
	addDir = func(d string, mode int64) error {
		if d == "/" || dirs[d] {
			return nil
		}
		if err := addDir(path.Dir(d), 0o755); err != nil {
			return err
		}
		dirs[d] = true
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d[1:] + "/", Mode: mode})
	}
	file := func(p string, mode int64, b []byte) error {
		if err := addDir(path.Dir(p), 0o755); err != nil {
			return err
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: p[1:], Mode: mode, Size: int64(len(b))}); err != nil {
			return err
		}
		_, err := tw.Write(b)
		return err
	}
	if err := addDir("/tmp", 0o1777); err != nil {
		return err
	}
	if err := file("/bin/busybox", 0o755, bin); err != nil {
		return err
	}
	if err := file("/etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n")); err != nil {
		return err
	}
	if err := file("/etc/group", 0o644, []byte("root:x:0:\nnogroup:x:65534:\n")); err != nil {
		return err
	}
	for _, l := range links {
		if err := addDir(path.Dir(l), 0o755); err != nil {
			return err
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: l[1:], Linkname: "/bin/busybox", Mode: 0o777}); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return os.WriteFile(out, buf.Bytes(), 0o644)
}
