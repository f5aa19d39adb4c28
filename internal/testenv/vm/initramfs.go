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

package vm

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// Guest locations of the files the harness itself adds.
const (
	guestBusybox    = "/usr/bin/busybox"
	guestConfigDir  = "/etc/mpnbd-vm"
	guestModulesDir = "/usr/lib/mpnbd-vm/modules"
)

// entry is one file system object of the initramfs.
type entry struct {
	mode  fs.FileMode
	data  []byte // contents of a generated regular file
	src   string // host file holding the contents of a regular file
	link  string // target of a symlink
	major uint32 // device numbers of a character device
	minor uint32
}

// rootfs is the initramfs being assembled, keyed by canonical guest path.
type rootfs map[string]*entry

// canon returns the path a guest path has in the merged-/usr layout of
// the initramfs, in which /bin, /sbin, /lib and /lib64 are symlinks into
// /usr.
func canon(p string) (string, error) {
	if !strings.HasPrefix(p, "/") {
		return "", fmt.Errorf("vm: guest path %q is not absolute", p)
	}
	p = path.Clean(p)
	if p == "/" {
		return "", fmt.Errorf("vm: guest path %q names the root", p)
	}
	for _, d := range []string{"/bin", "/sbin", "/lib", "/lib64"} {
		if p == d || strings.HasPrefix(p, d+"/") {
			return "/usr" + p, nil
		}
	}
	return p, nil
}

func (r rootfs) add(guest string, e *entry) error {
	p, err := canon(guest)
	if err != nil {
		return err
	}
	r[p] = e
	return nil
}

func (r rootfs) file(guest string, mode fs.FileMode, data string) error {
	return r.add(guest, &entry{mode: mode, data: []byte(data)})
}

// copyHost adds a host file (following symlinks) or directory tree.
func (r rootfs) copyHost(guest, host string) error {
	st, err := os.Stat(host)
	if err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	if !st.IsDir() {
		if !st.Mode().IsRegular() {
			return fmt.Errorf("vm: %s is not a regular file", host)
		}
		return r.add(guest, &entry{mode: st.Mode().Perm(), src: host})
	}
	return filepath.WalkDir(host, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(host, p)
		if err != nil {
			return err
		}
		g := path.Join(guest, filepath.ToSlash(rel))
		st, err := os.Stat(p) // follow symlinks
		if err != nil {
			return fmt.Errorf("vm: %w", err)
		}
		switch {
		case st.IsDir():
			if d.Type()&fs.ModeSymlink != 0 {
				return r.copyHost(g, p)
			}
			return r.add(g, &entry{mode: fs.ModeDir | st.Mode().Perm()})
		case st.Mode().IsRegular():
			return r.add(g, &entry{mode: st.Mode().Perm(), src: p})
		}
		return nil // sockets, devices, ...
	})
}

// sharedLibs returns the shared libraries (and the dynamic loader) that a
// host executable needs, as ldd reports them; none for a static one.
func sharedLibs(bin string) ([]string, error) {
	out, err := exec.Command("ldd", bin).CombinedOutput()
	if err != nil {
		if bytes.Contains(out, []byte("not a dynamic executable")) || bytes.Contains(out, []byte("statically linked")) {
			return nil, nil
		}
		return nil, fmt.Errorf("vm: ldd %s: %v: %s", bin, err, bytes.TrimSpace(out))
	}
	var libs []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if strings.Contains(l, "=> not found") {
			return nil, fmt.Errorf("vm: ldd %s: %s", bin, l)
		}
		if _, after, ok := strings.Cut(l, "=>"); ok {
			l = strings.TrimSpace(after)
		}
		if !strings.HasPrefix(l, "/") {
			continue // linux-vdso.so.1, "statically linked"
		}
		if i := strings.Index(l, " ("); i >= 0 {
			l = l[:i]
		}
		libs = append(libs, l)
	}
	return libs, nil
}

// addTool adds a host executable and its shared libraries.
func (r rootfs) addTool(tool string) (string, error) {
	p := tool
	if !strings.Contains(p, "/") {
		lp, err := exec.LookPath(p)
		if err != nil {
			return "", fmt.Errorf("vm: tool %w", err)
		}
		p = lp
	}
	p, err := filepath.Abs(p)
	if err != nil {
		return "", err
	}
	st, err := os.Stat(p)
	if err != nil {
		return "", fmt.Errorf("vm: tool: %w", err)
	}
	if !st.Mode().IsRegular() {
		return "", fmt.Errorf("vm: tool %s is not a regular file", p)
	}
	if err := r.add(p, &entry{mode: 0o755, src: p}); err != nil {
		return "", err
	}
	libs, err := sharedLibs(p)
	if err != nil {
		return "", err
	}
	for _, l := range libs {
		if err := r.add(l, &entry{mode: 0o755, src: l}); err != nil {
			return "", err
		}
	}
	return p, nil
}

// busyboxApplets lists the applets of a busybox binary with the guest
// paths busybox installs them to.
func busyboxApplets(bb string) ([]string, error) {
	out, err := exec.Command(bb, "--list-full").Output()
	if err == nil {
		var list []string
		for _, l := range strings.Fields(string(out)) {
			list = append(list, "/"+strings.TrimPrefix(l, "/"))
		}
		return list, nil
	}
	out, err2 := exec.Command(bb, "--list").Output()
	if err2 != nil {
		return nil, fmt.Errorf("vm: %s --list: %w", bb, err)
	}
	var list []string
	for _, l := range strings.Fields(string(out)) {
		list = append(list, "/usr/bin/"+l)
	}
	return list, nil
}

var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// buildInitramfs writes the initramfs (an uncompressed newc cpio archive,
// which the kernel unpacks fastest) for cfg to dst.
func buildInitramfs(dst string, cfg *Config, nonce string) error {
	r := rootfs{}
	for _, d := range []string{"/dev", "/proc", "/sys", "/run", "/root", "/etc", "/mnt", "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib64", "/var"} {
		r[d] = &entry{mode: fs.ModeDir | 0o755}
	}
	r["/tmp"] = &entry{mode: fs.ModeDir | fs.ModeSticky | 0o777}
	r["/var/tmp"] = &entry{mode: fs.ModeDir | fs.ModeSticky | 0o777}
	r["/var/run"] = &entry{mode: fs.ModeSymlink | 0o777, link: "../run"}
	for _, d := range []string{"bin", "sbin", "lib", "lib64"} {
		r["/"+d] = &entry{mode: fs.ModeSymlink | 0o777, link: "usr/" + d}
	}
	// The kernel opens /dev/console for init before devtmpfs is mounted.
	r["/dev/console"] = &entry{mode: fs.ModeDevice | fs.ModeCharDevice | 0o600, major: 5, minor: 1}

	bb := cfg.Busybox
	if bb == "" {
		bb = "busybox"
	}
	bbPath, err := r.addTool(bb)
	if err != nil {
		return err
	}
	// Move busybox to its fixed guest location.
	bbCanon, _ := canon(bbPath)
	if bbCanon != guestBusybox {
		r[guestBusybox] = r[bbCanon]
		delete(r, bbCanon)
	}

	// Files and tools, remembering the names that must not be shadowed by
	// busybox applets.
	provided := map[string]bool{}
	guests := make([]string, 0, len(cfg.Files))
	for g := range cfg.Files {
		guests = append(guests, g)
	}
	sort.Strings(guests)
	for _, g := range guests {
		if err := r.copyHost(g, cfg.Files[g]); err != nil {
			return err
		}
	}
	for _, t := range cfg.Tools {
		p, err := r.addTool(t)
		if err != nil {
			return err
		}
		provided[path.Base(p)] = true
	}

	applets, err := busyboxApplets(bbPath)
	if err != nil {
		return err
	}
	for _, a := range applets {
		c, err := canon(a)
		if err != nil || provided[path.Base(c)] {
			continue
		}
		if _, ok := r[c]; !ok {
			r[c] = &entry{mode: fs.ModeSymlink | 0o777, link: guestBusybox}
		}
	}
	r["/usr/bin/sh"] = &entry{mode: fs.ModeSymlink | 0o777, link: guestBusybox}

	// Modules, loaded in order by init.
	var modList strings.Builder
	for i, m := range cfg.Modules {
		fields := strings.Fields(m)
		if len(fields) == 0 {
			continue
		}
		g := fmt.Sprintf("%s/%02d-%s", guestModulesDir, i, filepath.Base(fields[0]))
		if err := r.copyHost(g, fields[0]); err != nil {
			return err
		}
		fmt.Fprintf(&modList, "%s %s\n", g, strings.Join(fields[1:], " "))
	}

	// Minimal identity files unless the caller brought its own.
	defaults := map[string]string{
		"/etc/passwd":   "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
		"/etc/group":    "root:x:0:\nnogroup:x:65534:\n",
		"/etc/hosts":    "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
		"/etc/hostname": "mpnbd-vm\n",
	}
	for g, data := range defaults {
		if _, ok := r[g]; !ok {
			if err := r.file(g, 0o644, data); err != nil {
				return err
			}
		}
	}

	var env strings.Builder
	keys := make([]string, 0, len(cfg.Env))
	for k := range cfg.Env {
		if !envName.MatchString(k) {
			return fmt.Errorf("vm: invalid environment variable name %q", k)
		}
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&env, "export %s=%s\n", k, shellQuote(cfg.Env[k]))
	}

	if err := r.file(guestConfigDir+"/modules", 0o644, modList.String()); err != nil {
		return err
	}
	if err := r.file(guestConfigDir+"/env", 0o644, env.String()); err != nil {
		return err
	}
	if err := r.file(guestConfigDir+"/payload", 0o755, cfg.Cmd+"\n"); err != nil {
		return err
	}
	// The NIC of the host forwards, set up by init (fail is its own).
	net := ""
	if len(cfg.HostForwards) > 0 {
		net = fmt.Sprintf("ip link set eth0 up || fail \"eth0 up\"\nip addr add %s/24 dev eth0 || fail \"eth0's address\"\n", GuestAddr)
	}
	if err := r.file(guestConfigDir+"/net", 0o644, net); err != nil {
		return err
	}
	if err := r.file("/init", 0o755, initScript(nonce)); err != nil {
		return err
	}

	f, err := os.Create(dst)
	if err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	w := bufio.NewWriterSize(f, 1<<20)
	if err := r.writeCpio(w); err != nil {
		f.Close()
		return err
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return fmt.Errorf("vm: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	return nil
}

// writeCpio writes r as a newc cpio archive, each directory before its
// contents.
func (r rootfs) writeCpio(w io.Writer) error {
	// Add missing parent directories.
	for p := range r {
		for d := path.Dir(p); d != "/"; d = path.Dir(d) {
			if _, ok := r[d]; !ok {
				r[d] = &entry{mode: fs.ModeDir | 0o755}
			}
		}
	}
	paths := make([]string, 0, len(r))
	for p := range r {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	cw := &cpioWriter{w: w}
	for _, p := range paths {
		if err := cw.add(strings.TrimPrefix(p, "/"), r[p]); err != nil {
			return err
		}
	}
	return cw.trailer()
}

// cpioWriter writes the "newc" (SVR4, no CRC) cpio format that the
// kernel's initramfs unpacker reads.
type cpioWriter struct {
	w   io.Writer
	ino uint32
	off int64
}

func (c *cpioWriter) write(b []byte) error {
	n, err := c.w.Write(b)
	c.off += int64(n)
	return err
}

func (c *cpioWriter) pad() error {
	if n := (4 - c.off%4) % 4; n > 0 {
		return c.write(make([]byte, n))
	}
	return nil
}

func (c *cpioWriter) header(name string, mode uint32, nlink uint32, size int64, major, minor uint32) error {
	c.ino++
	h := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		c.ino, mode, 0, 0, nlink, 0, size, 0, 0, major, minor, len(name)+1, 0)
	if err := c.write([]byte(h)); err != nil {
		return err
	}
	if err := c.write(append([]byte(name), 0)); err != nil {
		return err
	}
	return c.pad()
}

// Mode type bits of cpio (and stat).
const (
	sIFDIR = 0o040000
	sIFCHR = 0o020000
	sIFREG = 0o100000
	sIFLNK = 0o120000
)

func unixMode(m fs.FileMode) uint32 {
	u := uint32(m.Perm())
	if m&fs.ModeSticky != 0 {
		u |= 0o1000
	}
	if m&fs.ModeSetgid != 0 {
		u |= 0o2000
	}
	if m&fs.ModeSetuid != 0 {
		u |= 0o4000
	}
	return u
}

func (c *cpioWriter) add(name string, e *entry) error {
	mode := unixMode(e.mode)
	switch {
	case e.mode&fs.ModeDir != 0:
		return c.header(name, sIFDIR|mode, 2, 0, 0, 0)
	case e.mode&fs.ModeSymlink != 0:
		if err := c.header(name, sIFLNK|0o777, 1, int64(len(e.link)), 0, 0); err != nil {
			return err
		}
		if err := c.write([]byte(e.link)); err != nil {
			return err
		}
		return c.pad()
	case e.mode&fs.ModeCharDevice != 0:
		return c.header(name, sIFCHR|mode, 1, 0, e.major, e.minor)
	}
	if e.src == "" {
		if err := c.header(name, sIFREG|mode, 1, int64(len(e.data)), 0, 0); err != nil {
			return err
		}
		if err := c.write(e.data); err != nil {
			return err
		}
		return c.pad()
	}
	f, err := os.Open(e.src)
	if err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	if err := c.header(name, sIFREG|mode, 1, st.Size(), 0, 0); err != nil {
		return err
	}
	n, err := io.CopyN(c.w, f, st.Size())
	c.off += n
	if err != nil {
		return fmt.Errorf("vm: copy %s: %w", e.src, err)
	}
	return c.pad()
}

func (c *cpioWriter) trailer() error {
	if err := c.header("TRAILER!!!", 0, 1, 0, 0, 0); err != nil {
		return err
	}
	// The kernel reads the archive in whole blocks; pad to 512 bytes.
	if n := (512 - c.off%512) % 512; n > 0 {
		return c.write(make([]byte, n))
	}
	return nil
}
