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
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
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

// Build writes the image as a docker-archive tarball (manifest.json, the
// config, each layer as an uncompressed tar named by its digest) that
// `ctr images import` takes. Nothing is compressed: the suites' test
// binaries run under the race detector, where gzip costs a minute for a
// root file system and the digests (assembly) cost nothing.
func (im Image) Build(out string) error {
	if _, err := name.ParseReference(im.Ref); err != nil {
		return err
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	bw := bufio.NewWriterSize(f, 1<<20)
	tw := tar.NewWriter(bw)
	var diffIDs, layers []string
	// add writes one layer of size bytes that open reads, twice: for its
	// digest, then into the archive.
	add := func(size int64, open func() (io.ReadCloser, error)) error {
		h := sha256.New()
		r, err := open()
		if err != nil {
			return err
		}
		n, err := io.Copy(h, r)
		r.Close()
		if err != nil {
			return err
		}
		if n != size {
			return fmt.Errorf("a layer of %d bytes read as %d", size, n)
		}
		sum := hex.EncodeToString(h.Sum(nil))
		diffIDs = append(diffIDs, "sha256:"+sum)
		entry := sum + "/layer.tar"
		if slices.Contains(layers, entry) {
			layers = append(layers, entry)
			return nil
		}
		layers = append(layers, entry)
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: sum + "/", Mode: 0o755}); err != nil {
			return err
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: entry, Mode: 0o644, Size: size}); err != nil {
			return err
		}
		if r, err = open(); err != nil {
			return err
		}
		defer r.Close()
		if _, err := io.CopyN(tw, r, size); err != nil {
			return fmt.Errorf("copying a layer: %w", err)
		}
		return nil
	}
	file := func(data []byte, name string) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(data))}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	err = func() error {
		for _, p := range im.BaseLayers {
			st, err := os.Stat(p)
			if err != nil {
				return fmt.Errorf("image %s: layer %s: %w", im.Ref, p, err)
			}
			if err := add(st.Size(), func() (io.ReadCloser, error) { return os.Open(p) }); err != nil {
				return fmt.Errorf("image %s: layer %s: %w", im.Ref, p, err)
			}
		}
		if len(im.Files) > 0 {
			b, err := filesTar(im.Files)
			if err != nil {
				return fmt.Errorf("image %s: %w", im.Ref, err)
			}
			if err := add(int64(len(b)), func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }); err != nil {
				return err
			}
		}
		cfg, err := json.Marshal(imageConfig{
			Architecture: "amd64", OS: "linux",
			Config: imageRunConfig{Entrypoint: im.Entrypoint,
				Env: append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, im.Env...)},
			RootFS: imageRootFS{Type: "layers", DiffIDs: diffIDs},
		})
		if err != nil {
			return err
		}
		cfgName := fmt.Sprintf("%x.json", sha256.Sum256(cfg))
		if err := file(cfg, cfgName); err != nil {
			return err
		}
		manifest, err := json.Marshal([]archiveManifest{{Config: cfgName, RepoTags: []string{im.Ref}, Layers: layers}})
		if err != nil {
			return err
		}
		if err := file(manifest, "manifest.json"); err != nil {
			return err
		}
		if err := tw.Close(); err != nil {
			return err
		}
		return bw.Flush()
	}()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(out)
	}
	return err
}

// archiveManifest is a docker-archive's manifest.json entry.
type archiveManifest struct {
	Config   string   `json:"Config"`
	RepoTags []string `json:"RepoTags"`
	Layers   []string `json:"Layers"`
}

// imageConfig is the part of an image's config file the suites set.
type imageConfig struct {
	Architecture string         `json:"architecture"`
	OS           string         `json:"os"`
	Config       imageRunConfig `json:"config"`
	RootFS       imageRootFS    `json:"rootfs"`
}

type imageRunConfig struct {
	Entrypoint []string `json:"Entrypoint,omitempty"`
	Env        []string `json:"Env,omitempty"`
}

type imageRootFS struct {
	Type    string   `json:"type"`
	DiffIDs []string `json:"diff_ids"`
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
