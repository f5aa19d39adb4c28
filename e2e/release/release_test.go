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

package release

import (
	"archive/tar"
	"bytes"
	"context"
	"debug/buildinfo"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

const requireEnv = "MPNBD_RELEASE_REQUIRE"

// programs are the driver's commands in the image.
var programs = []string{"controller", "node", "nbd-server", "mpnbdctl"}

func unavailable(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv(requireEnv) == "1" {
		t.Fatalf("%s=1 but: %s", requireEnv, msg)
	}
	t.Skipf("skipping: %s (set %s=1 to fail instead)", msg, requireEnv)
}

func TestRelease(t *testing.T) {
	if os.Geteuid() != 0 {
		unavailable(t, "needs root (buildah, binfmt_misc)")
	}
	for _, tool := range []string{"buildah", "debootstrap", "gpg", "gpgv", "/usr/libexec/qemu-binfmt/aarch64-binfmt-P"} {
		if _, err := exec.LookPath(tool); err != nil {
			unavailable(t, "%s is missing: run hack/install-deps.sh", tool)
		}
	}
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()

	// As a maintainer runs it, with the chart's version.
	chartVersion := chartField(t, filepath.Join(root, "charts", "mpnbd", "Chart.yaml"), "version")
	out := t.TempDir()
	start := time.Now()
	if b, err := run(ctx, root, "bash", "hack/release.sh", "--out", out); err != nil {
		t.Fatalf("hack/release.sh: %v\n%s", err, tail(b, 60))
	}
	t.Logf("hack/release.sh made %s in %s", chartVersion, time.Since(start).Round(time.Second))
	want := map[string]bool{
		"SHA256SUMS": true, "SHA256SUMS.asc": true, "signing-key.asc": true,
		"mpnbd-" + chartVersion + ".tgz": true, "mpnbd-" + chartVersion + ".tgz.prov": true,
		"mpnbd-image-" + chartVersion + ".oci.tar": true, "mpnbd-image-" + chartVersion + ".digest": true,
		"mpnbd-image-" + chartVersion + ".amd64.spdx.json": true, "mpnbd-image-" + chartVersion + ".arm64.spdx.json": true,
	}
	entries, err := os.ReadDir(out)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if !want[e.Name()] {
			t.Errorf("unexpected file %s in the release", e.Name())
		}
		delete(want, e.Name())
	}
	for f := range want {
		t.Errorf("the release has no %s", f)
	}
	if t.Failed() {
		t.FailNow()
	}

	t.Run("verify", func(t *testing.T) { verify(ctx, t, root, out) })

	digestLine := strings.TrimSpace(readFile(t, filepath.Join(out, "mpnbd-image-"+chartVersion+".digest")))
	ref, digest, ok := strings.Cut(digestLine, "@")
	if !ok || !regexp.MustCompile(`^sha256:[0-9a-f]{64}$`).MatchString(digest) {
		t.Fatalf(".digest holds %q, want REF@sha256:...", digestLine)
	}
	t.Run("image", func(t *testing.T) {
		images := images(t, filepath.Join(out, "mpnbd-image-"+chartVersion+".oci.tar"), digest)
		for _, arch := range []string{"amd64", "arm64"} {
			img, ok := images[arch]
			if !ok {
				t.Errorf("the index has no linux/%s image", arch)
				continue
			}
			var sbom sbomDoc
			if err := json.Unmarshal([]byte(readFile(t, filepath.Join(out, "mpnbd-image-"+chartVersion+"."+arch+".spdx.json"))), &sbom); err != nil {
				t.Fatalf("%s SBOM: %v", arch, err)
			}
			checkImage(t, img, arch, chartVersion, sbom)
		}
	})
	t.Run("chart", func(t *testing.T) { checkChart(ctx, t, root, out, chartVersion, ref) })
	t.Run("changelog", func(t *testing.T) {
		base, _, _ := strings.Cut(chartVersion, "-")
		if !regexp.MustCompile(`(?m)^## ` + regexp.QuoteMeta(base) + `\b`).MatchString(readFile(t, filepath.Join(root, "CHANGELOG.md"))) {
			t.Errorf("CHANGELOG.md has no section for %s", base)
		}
	})
}

// verify runs hack/verify-release.sh over the release, then over copies
// with one change each, which it must refuse for the right reason.
func verify(ctx context.Context, t *testing.T, root, out string) {
	key := filepath.Join(out, "signing-key.asc")
	if b, err := run(ctx, root, "bash", "hack/verify-release.sh", out, key); err != nil {
		t.Fatalf("hack/verify-release.sh refuses the release: %v\n%s", err, b)
	} else if n := strings.Count(string(b), "ok:"); n < 4 {
		t.Errorf("hack/verify-release.sh checked %d things, want 4 at least:\n%s", n, b)
	}
	for _, c := range []struct {
		name, why string
		change    func(t *testing.T, dir string)
	}{
		{"a changed SBOM", "differs from SHA256SUMS", func(t *testing.T, dir string) {
			appendTo(t, filepath.Join(dir, sbomName(dir, "arm64")), " ")
		}},
		{"a changed SBOM and its digest in SHA256SUMS", "bad signature", func(t *testing.T, dir string) {
			f := sbomName(dir, "arm64")
			appendTo(t, filepath.Join(dir, f), " ")
			b, err := run(ctx, dir, "sha256sum", f)
			if err != nil {
				t.Fatal(err)
			}
			sums := readFile(t, filepath.Join(dir, "SHA256SUMS"))
			var lines []string
			for _, l := range strings.Split(strings.TrimSpace(sums), "\n") {
				if strings.HasSuffix(l, " "+f) {
					l = strings.TrimSpace(string(b))
				}
				lines = append(lines, l)
			}
			writeFile(t, filepath.Join(dir, "SHA256SUMS"), strings.Join(lines, "\n")+"\n")
		}},
		{"a file added", "the directory holds", func(t *testing.T, dir string) {
			writeFile(t, filepath.Join(dir, "extra.yaml"), "kind: Nothing\n")
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			if b, err := run(ctx, root, "cp", "-a", out+"/.", dir); err != nil {
				t.Fatalf("cp: %v: %s", err, b)
			}
			c.change(t, dir)
			b, err := run(ctx, root, "bash", "hack/verify-release.sh", dir, key)
			if err == nil {
				t.Fatalf("hack/verify-release.sh accepts a release with %s:\n%s", c.name, b)
			}
			if !strings.Contains(string(b), c.why) {
				t.Errorf("hack/verify-release.sh refused %s, but not with %q:\n%s", c.name, c.why, b)
			}
		})
	}
}

func sbomName(dir, arch string) string {
	m, _ := filepath.Glob(filepath.Join(dir, "*."+arch+".spdx.json"))
	if len(m) == 0 {
		return "missing." + arch + ".spdx.json"
	}
	return filepath.Base(m[0])
}

// images opens the archive's OCI layout and returns the images of the index
// it names, by architecture; the index must have the digest given.
func images(t *testing.T, archive, digest string) map[string]v1.Image {
	dir := t.TempDir()
	if b, err := exec.Command("tar", "-xf", archive, "-C", dir).CombinedOutput(); err != nil {
		t.Fatalf("tar: %v: %s", err, b)
	}
	lp, err := layout.FromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	top, err := lp.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	tm, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(tm.Manifests) != 1 || tm.Manifests[0].Digest.String() != digest {
		t.Fatalf("the archive's index.json lists %+v, want one entry, %s", tm.Manifests, digest)
	}
	idx, err := top.ImageIndex(tm.Manifests[0].Digest)
	if err != nil {
		t.Fatalf("the entry is no image index: %v", err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]v1.Image{}
	for _, m := range im.Manifests {
		img, err := idx.Image(m.Digest)
		if err != nil {
			t.Fatal(err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if m.Platform == nil || m.Platform.OS != "linux" || m.Platform.Architecture != cf.Architecture {
			t.Errorf("manifest %s: platform %+v in the index, %s/%s in its config", m.Digest, m.Platform, cf.OS, cf.Architecture)
		}
		out[cf.Architecture] = img
	}
	if len(im.Manifests) != 2 {
		t.Errorf("the index holds %d images, want 2", len(im.Manifests))
	}
	return out
}

// checkImage reads the image's file system: each program an ELF of the
// architecture, built for it at the version, its modules in the SBOM; the
// runtime packages of the architecture too.
func checkImage(t *testing.T, img v1.Image, arch, version string, sbom sbomDoc) {
	machine := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[arch]
	dir := t.TempDir()
	files := extract(t, img, dir, func(name string) bool {
		return path.Dir(name) == "usr/local/bin" || name == "usr/sbin/mke2fs" || name == "usr/sbin/mkfs.xfs"
	})
	purls := sbom.purls()
	for _, want := range append(append([]string(nil), programs...), "mke2fs", "mkfs.xfs") {
		file, ok := files[want]
		if !ok {
			t.Errorf("linux/%s: no %s in the image", arch, want)
			continue
		}
		f, err := elf.Open(file)
		if err != nil {
			t.Errorf("linux/%s: %s is no ELF file: %v", arch, want, err)
			continue
		}
		if f.Machine != machine {
			t.Errorf("linux/%s: %s is built for %s", arch, want, f.Machine)
		}
		f.Close()
		if want == "mke2fs" || want == "mkfs.xfs" {
			continue
		}
		info, err := buildinfo.ReadFile(file)
		if err != nil {
			t.Errorf("linux/%s: %s: no Go build information: %v", arch, want, err)
			continue
		}
		settings := map[string]string{}
		for _, s := range info.Settings {
			settings[s.Key] = s.Value
		}
		if settings["GOARCH"] != arch || settings["GOOS"] != "linux" {
			t.Errorf("linux/%s: %s built for %s/%s", arch, want, settings["GOOS"], settings["GOARCH"])
		}
		// -trimpath keeps -ldflags out of the build information: the
		// version the build stamps is a string of the program's.
		if data, err := os.ReadFile(file); err != nil || !bytes.Contains(data, []byte(version)) {
			t.Errorf("linux/%s: %s not stamped with version %s (%v)", arch, want, version, err)
		}
		if want == "mpnbdctl" {
			checkRuns(t, file, arch, version)
		}
		missing := 0
		for _, m := range info.Deps {
			if m.Replace != nil {
				m = m.Replace
			}
			if !purls["pkg:golang/"+m.Path+"@"+m.Version] {
				missing++
				if missing <= 5 {
					t.Errorf("linux/%s SBOM: %s links %s@%s, which it does not list", arch, want, m.Path, m.Version)
				}
			}
		}
		if len(info.Deps) < 20 {
			t.Errorf("linux/%s: %s links only %d modules: not the driver's program?", arch, want, len(info.Deps))
		}
	}
	found := false
	for p := range purls {
		if strings.HasPrefix(p, "pkg:deb/debian/e2fsprogs@") && strings.Contains(p, "arch="+arch) {
			found = true
		}
	}
	if !found {
		t.Errorf("linux/%s SBOM lists no e2fsprogs of %s", arch, arch)
	}
}

// checkRuns runs mpnbdctl of the image (an arm64 one under qemu-user-static
// through binfmt_misc) and reads its own version, which it prints before it
// fails for want of a cluster.
func checkRuns(t *testing.T, file, arch, version string) {
	if err := os.Chmod(file, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, file, "version", "-o", "json", "--kubeconfig", filepath.Join(t.TempDir(), "none"))
	out, err := cmd.Output()
	var rep struct {
		Client struct {
			Version string `json:"version"`
		} `json:"client"`
	}
	if jerr := json.Unmarshal(out, &rep); jerr != nil {
		t.Errorf("linux/%s: mpnbdctl version: %v, %v: %q", arch, err, jerr, out)
		return
	}
	if rep.Client.Version != version {
		t.Errorf("linux/%s: mpnbdctl version says %q, want %q", arch, rep.Client.Version, version)
	}
}

// extract writes the image's files that keep selects (by path without a
// leading slash) under dir, following the layers as a runtime would, and
// returns them by base name.
func extract(t *testing.T, img v1.Image, dir string, keep func(string) bool) map[string]string {
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	out := map[string]string{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		name := strings.TrimPrefix(path.Clean("/"+h.Name), "/")
		if h.Typeflag != tar.TypeReg || !keep(name) {
			continue
		}
		dst := filepath.Join(dir, path.Base(name))
		f, err := os.Create(dst)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(f, tr); err != nil {
			t.Fatal(err)
		}
		f.Close()
		out[path.Base(name)] = dst
	}
	return out
}

// checkChart: the packaged chart carries the version, its default image is
// the release's, and the repository's chart names the same by default.
func checkChart(ctx context.Context, t *testing.T, root, out, version, ref string) {
	helm := helmPath(ctx, t, root)
	tgz := filepath.Join(out, "mpnbd-"+version+".tgz")
	b, err := run(ctx, root, helm, "show", "chart", tgz)
	if err != nil {
		t.Fatalf("helm show chart: %v: %s", err, b)
	}
	for _, f := range []string{"version", "appVersion"} {
		if got := chartFieldOf(string(b), f); got != version {
			t.Errorf("the packaged chart's %s is %q, want %q", f, got, version)
		}
	}
	for _, chart := range []string{tgz, filepath.Join(root, "charts", "mpnbd")} {
		b, err := run(ctx, root, helm, "template", "mpnbd", chart, "--kube-version", "1.34.0",
			"--set", "apiServer.host=10.0.0.1", "--set", "apiServer.port=6443")
		if err != nil {
			t.Fatalf("helm template %s: %v: %s", chart, err, tail(b, 20))
		}
		images := map[string]bool{}
		for _, m := range regexp.MustCompile(`(?m)^\s+image: "?([^"\s]+)"?$`).FindAllStringSubmatch(string(b), -1) {
			if strings.Contains(m[1], "/mpnbd") {
				images[m[1]] = true
			}
		}
		if len(images) != 1 || !images[ref] {
			t.Errorf("%s renders the driver's image as %v, want only %s (the release's)", chart, keys(images), ref)
		}
	}
}

func helmPath(ctx context.Context, t *testing.T, root string) string {
	b, err := run(ctx, root, "bash", "hack/tools.sh")
	if err != nil {
		t.Fatalf("hack/tools.sh: %v: %s", err, b)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "HELM="); ok {
			return v
		}
	}
	t.Fatalf("hack/tools.sh printed no HELM=: %s", b)
	return ""
}

type sbomDoc struct {
	SPDXVersion string `json:"spdxVersion"`
	Packages    []struct {
		ExternalRefs []struct {
			Locator string `json:"referenceLocator"`
		} `json:"externalRefs"`
	} `json:"packages"`
}

func (d sbomDoc) purls() map[string]bool {
	out := map[string]bool{}
	for _, p := range d.Packages {
		for _, r := range p.ExternalRefs {
			out[r.Locator] = true
		}
	}
	return out
}

func run(ctx context.Context, dir, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	return cmd.CombinedOutput()
}

func chartField(t *testing.T, file, field string) string {
	v := chartFieldOf(readFile(t, file), field)
	if v == "" {
		t.Fatalf("%s has no %s", file, field)
	}
	return v
}

func chartFieldOf(text, field string) string {
	m := regexp.MustCompile(`(?m)^` + field + `:\s*"?([^"\s]+)"?\s*$`).FindStringSubmatch(text)
	if m == nil {
		return ""
	}
	return m[1]
}

func readFile(t *testing.T, f string) string {
	b, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func writeFile(t *testing.T, f, s string) {
	if err := os.WriteFile(f, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

func appendTo(t *testing.T, f, s string) {
	b := readFile(t, f)
	writeFile(t, f, b+s)
}

func tail(b []byte, n int) string {
	lines := bytes.Split(bytes.TrimSpace(b), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

func keys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}
