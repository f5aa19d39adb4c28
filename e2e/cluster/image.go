package cluster

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"slices"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Image describes an OCI image built from files on this machine.
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
