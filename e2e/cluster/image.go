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
	"bytes"
	"context"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// BuildDockerfileImage builds the driver's image from the repository's
// Dockerfile, as users build it, with hack/image.sh (buildah, base images
// made on this machine), tagged ref, its commands stamped with version
// (the Dockerfile's VERSION build arg), and writes it to out as a
// docker-archive tarball that `ctr images import` takes. The build's
// output goes to log.
func BuildDockerfileImage(ctx context.Context, ref, version, out string, log io.Writer) error {
	root, err := repo.Root()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(root, "hack", "image.sh"),
		"--tag", ref, "--version", version, "--out", out)
	cmd.Dir = root
	cmd.Stderr = log
	// Cancelled, buildah and everything else the script started stop too.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	stdout, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("hack/image.sh: %w", err)
	}
	for _, l := range strings.Split(string(stdout), "\n") {
		if v, ok := strings.CutPrefix(l, "IMAGE_TAR="); ok {
			if v != out {
				return fmt.Errorf("hack/image.sh wrote %s, want %s", v, out)
			}
			_, err := os.Stat(out)
			return err
		}
	}
	return fmt.Errorf("hack/image.sh printed no IMAGE_TAR=: %s", stdout)
}

// lastLines returns the last n lines of a build's log.
func lastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// Image describes an OCI image built from files on this machine, for the
// images the suite needs beside the driver's (the driver's own comes from
// its Dockerfile: BuildDockerfileImage).
type Image struct {
	// Ref names it, e.g. "mpnbd/mpnbd:e2e".
	Ref string
	// BaseLayers are tar files of root file systems (e.g. a debootstrap'ed
	// Debian), applied first.
	BaseLayers []string
	// Files maps paths in the image to files on this machine; they form
	// the top layer (mode kept).
	Files map[string]string
	// Entrypoint and Env of the image's config.
	Entrypoint []string
	Env        []string
}

// Build writes the image as a docker-archive/OCI tarball that
// `ctr images import` takes.
func (im Image) Build(out string) error {
	ref, err := name.ParseReference(im.Ref)
	if err != nil {
		return err
	}
	var layers []v1.Layer
	for _, p := range im.BaseLayers {
		l, err := tarball.LayerFromFile(p)
		if err != nil {
			return fmt.Errorf("image %s: layer %s: %w", im.Ref, p, err)
		}
		layers = append(layers, l)
	}
	if len(im.Files) > 0 {
		b, err := filesTar(im.Files)
		if err != nil {
			return fmt.Errorf("image %s: %w", im.Ref, err)
		}
		l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
		if err != nil {
			return err
		}
		layers = append(layers, l)
	}
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		return err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config.Entrypoint = im.Entrypoint
	cf.Config.Env = append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, im.Env...)
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return err
	}
	return tarball.WriteToFile(out, ref, img)
}

// filesTar makes a layer of the given files and their parent directories.
func filesTar(files map[string]string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	var addDir func(d string) error
	addDir = func(d string) error {
		if d == "/" || d == "." || dirs[d] {
			return nil
		}
		if err := addDir(path.Dir(d)); err != nil {
			return err
		}
		dirs[d] = true
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d[1:] + "/", Mode: 0o755})
	}
	for _, dst := range slices.Sorted(maps.Keys(files)) {
		src := files[dst]
		if !path.IsAbs(dst) {
			return nil, fmt.Errorf("image path %q is not absolute", dst)
		}
		if err := addDir(path.Dir(dst)); err != nil {
			return nil, err
		}
		b, err := os.ReadFile(src)
		if err != nil {
			return nil, err
		}
		st, err := os.Stat(src)
		if err != nil {
			return nil, err
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: dst[1:], Mode: int64(st.Mode().Perm()), Size: int64(len(b))}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(b); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
