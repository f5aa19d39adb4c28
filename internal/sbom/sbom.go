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

// Package sbom writes the software bill of materials of the driver's image
// as an SPDX 2.3 JSON document, from what the image itself holds: the Go
// build information of each of its Go programs (the main module, every
// module linked in, the toolchain) and Debian's package database (every
// installed package). Nothing is taken from the source tree, so the
// document describes the bytes that ship, whatever built them.
//
// Each package carries a package URL (purl) so that scanners can match it
// against advisories: pkg:golang/PATH@VERSION for modules, pkg:deb/debian/
// NAME@VERSION?arch=ARCH&distro=debian-N for Debian's. Licences are given
// as NOASSERTION: neither source states them in a machine-readable form.
package sbom

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"debug/buildinfo"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"sort"
	"strings"
	"time"
)

// Image names the image a document describes.
type Image struct {
	// Name is the image's reference without its tag, e.g. ghcr.io/mpnbd/mpnbd.
	Name string
	// Version is its tag and the driver's version.
	Version string
	// Arch is its architecture (amd64, arm64).
	Arch string
	// Created is the document's creation time; zero means now.
	Created time.Time
}

// Document is the part of SPDX 2.3 this package writes.
type Document struct {
	SPDXVersion       string         `json:"spdxVersion"`
	DataLicense       string         `json:"dataLicense"`
	SPDXID            string         `json:"SPDXID"`
	Name              string         `json:"name"`
	DocumentNamespace string         `json:"documentNamespace"`
	CreationInfo      CreationInfo   `json:"creationInfo"`
	Packages          []Package      `json:"packages"`
	Relationships     []Relationship `json:"relationships"`
}

// CreationInfo says when and by what a document was made.
type CreationInfo struct {
	Created  string   `json:"created"`
	Creators []string `json:"creators"`
}

// Package is one SPDX package.
type Package struct {
	Name             string        `json:"name"`
	SPDXID           string        `json:"SPDXID"`
	VersionInfo      string        `json:"versionInfo,omitempty"`
	PrimaryPurpose   string        `json:"primaryPackagePurpose,omitempty"`
	DownloadLocation string        `json:"downloadLocation"`
	FilesAnalyzed    bool          `json:"filesAnalyzed"`
	LicenseConcluded string        `json:"licenseConcluded"`
	LicenseDeclared  string        `json:"licenseDeclared"`
	CopyrightText    string        `json:"copyrightText"`
	Checksums        []Checksum    `json:"checksums,omitempty"`
	ExternalRefs     []ExternalRef `json:"externalRefs,omitempty"`
	Comment          string        `json:"comment,omitempty"`
}

// Checksum of a package's file.
type Checksum struct {
	Algorithm string `json:"algorithm"`
	Value     string `json:"checksumValue"`
}

// ExternalRef is a package URL.
type ExternalRef struct {
	Category string `json:"referenceCategory"`
	Type     string `json:"referenceType"`
	Locator  string `json:"referenceLocator"`
}

// Relationship links two elements of the document.
type Relationship struct {
	Element string `json:"spdxElementId"`
	Type    string `json:"relationshipType"`
	Related string `json:"relatedSpdxElement"`
}

const noAssertion = "NOASSERTION"

// binDirs are where the image keeps the driver's programs.
var binDirs = []string{"usr/local/bin"}

// Generate reads the image's root file system at root and returns its
// document. It fails when the image holds no Go program or no Debian
// package database: a bill without them would describe nothing real.
func Generate(root string, im Image) (*Document, error) {
	created := im.Created
	if created.IsZero() {
		created = time.Now()
	}
	b := &builder{ids: map[string]bool{}, mods: map[string]string{}, version: im.Version}
	imageID := b.id("Image", im.Arch)
	b.doc = &Document{
		SPDXVersion: "SPDX-2.3",
		DataLicense: "CC0-1.0",
		SPDXID:      "SPDXRef-DOCUMENT",
		Name:        fmt.Sprintf("%s:%s (linux/%s)", im.Name, im.Version, im.Arch),
		CreationInfo: CreationInfo{
			Created:  created.UTC().Format(time.RFC3339),
			Creators: []string{"Tool: mpnbd-sbom-" + im.Version},
		},
	}
	b.add(Package{
		Name: im.Name, SPDXID: imageID, VersionInfo: im.Version, PrimaryPurpose: "CONTAINER",
		ExternalRefs: []ExternalRef{purl(ociPurl(im))},
	})
	b.relate("SPDXRef-DOCUMENT", "DESCRIBES", imageID)

	progs, err := b.goPrograms(root, imageID)
	if err != nil {
		return nil, err
	}
	if progs == 0 {
		return nil, fmt.Errorf("no Go program under %s in %s", strings.Join(binDirs, ", "), root)
	}
	debs, err := b.debianPackages(root, imageID)
	if err != nil {
		return nil, err
	}
	if debs == 0 {
		return nil, fmt.Errorf("no installed package in %s", filepath.Join(root, dpkgStatus))
	}
	// The namespace is unique to this content: the same image gives the
	// same namespace, another image another one.
	sum := sha256.New()
	for _, p := range b.doc.Packages {
		fmt.Fprintf(sum, "%s %s %v\n", p.SPDXID, p.VersionInfo, p.Checksums)
	}
	b.doc.DocumentNamespace = fmt.Sprintf("https://spdx.mpnbd.io/image/%s/%s/%s-%s",
		im.Version, im.Arch, path.Base(im.Name), hex.EncodeToString(sum.Sum(nil))[:16])
	return b.doc, nil
}

// Write encodes a document as indented JSON.
func (d *Document) Write(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(d)
}

type builder struct {
	doc  *Document
	ids  map[string]bool
	mods map[string]string // "path@version" -> SPDXID
	// version stands for the main module's when its programs say only
	// "(devel)" (built outside a tagged checkout; the release stamps it).
	version string
}

var idUnsafe = regexp.MustCompile(`[^A-Za-z0-9.-]+`)

// id makes a unique SPDX identifier from parts.
func (b *builder) id(parts ...string) string {
	base := "SPDXRef-" + strings.Trim(idUnsafe.ReplaceAllString(strings.Join(parts, "-"), "-"), "-")
	id := base
	for n := 2; b.ids[id]; n++ {
		id = fmt.Sprintf("%s-%d", base, n)
	}
	b.ids[id] = true
	return id
}

func (b *builder) add(p Package) {
	if p.DownloadLocation == "" {
		p.DownloadLocation = noAssertion
	}
	p.LicenseConcluded, p.LicenseDeclared, p.CopyrightText = noAssertion, noAssertion, noAssertion
	b.doc.Packages = append(b.doc.Packages, p)
}

func (b *builder) relate(a, typ, c string) {
	b.doc.Relationships = append(b.doc.Relationships, Relationship{Element: a, Type: typ, Related: c})
}

// goPrograms adds each Go program of the image, the modules it links and
// its toolchain, and returns how many programs it found.
func (b *builder) goPrograms(root, imageID string) (int, error) {
	n := 0
	for _, dir := range binDirs {
		entries, err := os.ReadDir(filepath.Join(root, dir))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return 0, err
		}
		for _, e := range entries {
			if !e.Type().IsRegular() {
				continue
			}
			file := filepath.Join(root, dir, e.Name())
			info, err := buildinfo.ReadFile(file)
			if err != nil {
				continue // not a Go program
			}
			digest, err := fileSHA256(file)
			if err != nil {
				return 0, err
			}
			progID := b.id("File", e.Name())
			b.add(Package{
				Name: "/" + path.Join(dir, e.Name()), SPDXID: progID, VersionInfo: b.version,
				PrimaryPurpose: "APPLICATION",
				Checksums:      []Checksum{{Algorithm: "SHA256", Value: digest}},
				Comment:        "built from " + info.Path + buildSummary(info),
			})
			b.relate(imageID, "CONTAINS", progID)
			mainVersion := info.Main.Version
			if mainVersion == "" || mainVersion == "(devel)" {
				mainVersion = b.version
			}
			b.relate(progID, "GENERATED_FROM", b.module(info.Main.Path, mainVersion, info.Main.Sum))
			for _, m := range info.Deps {
				if m.Replace != nil {
					m = m.Replace
				}
				b.relate(progID, "DEPENDS_ON", b.module(m.Path, m.Version, m.Sum))
			}
			b.relate(progID, "DEPENDS_ON", b.module("stdlib", info.GoVersion, ""))
			n++
		}
	}
	return n, nil
}

// buildSummary gives the settings that say how a program was built.
func buildSummary(info *debug.BuildInfo) string {
	var s []string
	for _, kv := range info.Settings {
		switch kv.Key {
		case "GOOS", "GOARCH", "CGO_ENABLED", "vcs.revision", "vcs.modified":
			s = append(s, kv.Key+"="+kv.Value)
		}
	}
	if len(s) == 0 {
		return ""
	}
	return " (" + strings.Join(s, " ") + ")"
}

// module returns the identifier of a module's package, adding it once.
func (b *builder) module(modPath, version, sum string) string {
	key := modPath + "@" + version
	if id, ok := b.mods[key]; ok {
		return id
	}
	id := b.id("Go", modPath, version)
	p := Package{
		Name: modPath, SPDXID: id, VersionInfo: version, PrimaryPurpose: "LIBRARY",
		ExternalRefs: []ExternalRef{purl("pkg:golang/" + purlPath(modPath) + "@" + url.PathEscape(version))},
	}
	if sum != "" {
		p.Comment = "go.sum " + sum
	}
	if modPath != "stdlib" && version != "" && version != "(devel)" {
		p.DownloadLocation = "https://proxy.golang.org/" + strings.ToLower(modPath) + "/@v/" + version + ".zip"
	}
	b.add(p)
	b.mods[key] = id
	return id
}

const dpkgStatus = "var/lib/dpkg/status"

// debianPackages adds every installed Debian package and returns how many.
func (b *builder) debianPackages(root, imageID string) (int, error) {
	f, err := os.Open(filepath.Join(root, dpkgStatus))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	defer f.Close()
	distro := "debian"
	if v := osRelease(root)["VERSION_ID"]; v != "" {
		distro += "-" + v
	}
	paras, err := paragraphs(f)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", dpkgStatus, err)
	}
	sort.Slice(paras, func(i, j int) bool { return paras[i]["Package"] < paras[j]["Package"] })
	n := 0
	for _, p := range paras {
		if p["Status"] != "install ok installed" || p["Package"] == "" {
			continue
		}
		q := url.Values{"arch": {p["Architecture"]}, "distro": {distro}}
		if src := strings.Fields(p["Source"]); len(src) > 0 && src[0] != p["Package"] {
			q.Set("upstream", src[0])
		}
		id := b.id("Deb", p["Package"], p["Architecture"])
		b.add(Package{
			Name: p["Package"], SPDXID: id, VersionInfo: p["Version"], PrimaryPurpose: "OPERATING-SYSTEM",
			ExternalRefs: []ExternalRef{purl("pkg:deb/debian/" + url.PathEscape(p["Package"]) + "@" +
				url.PathEscape(p["Version"]) + "?" + q.Encode())},
		})
		b.relate(imageID, "CONTAINS", id)
		n++
	}
	return n, nil
}

// paragraphs parses a deb822 file (the dpkg status database), keeping each
// field's first line.
func paragraphs(r io.Reader) ([]map[string]string, error) {
	var out []map[string]string
	cur := map[string]string{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.TrimSpace(line) == "":
			if len(cur) > 0 {
				out = append(out, cur)
				cur = map[string]string{}
			}
		case line[0] == ' ' || line[0] == '\t':
			// a continuation line
		default:
			k, v, ok := strings.Cut(line, ":")
			if !ok {
				return nil, fmt.Errorf("line %q is not a field", line)
			}
			cur[k] = strings.TrimSpace(v)
		}
	}
	if len(cur) > 0 {
		out = append(out, cur)
	}
	return out, sc.Err()
}

// osRelease reads the image's /etc/os-release (or /usr/lib/os-release).
func osRelease(root string) map[string]string {
	out := map[string]string{}
	for _, p := range []string{"etc/os-release", "usr/lib/os-release"} {
		data, err := os.ReadFile(filepath.Join(root, p))
		if err != nil {
			continue
		}
		for _, line := range bytes.Split(data, []byte("\n")) {
			k, v, ok := strings.Cut(string(line), "=")
			if ok {
				out[k] = strings.Trim(v, `"`)
			}
		}
		break
	}
	return out
}

func purl(locator string) ExternalRef {
	return ExternalRef{Category: "PACKAGE-MANAGER", Type: "purl", Locator: locator}
}

// purlPath escapes each segment of a module path for a package URL.
func purlPath(p string) string {
	segs := strings.Split(p, "/")
	for i, s := range segs {
		segs[i] = url.PathEscape(s)
	}
	return strings.Join(segs, "/")
}

// ociPurl is the image's package URL: pkg:oci/NAME@VERSION?repository_url=...
func ociPurl(im Image) string {
	q := url.Values{"repository_url": {im.Name}, "tag": {im.Version}, "arch": {im.Arch}}
	return "pkg:oci/" + url.PathEscape(path.Base(im.Name)) + "?" + q.Encode()
}

func fileSHA256(file string) (string, error) {
	f, err := os.Open(file)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
