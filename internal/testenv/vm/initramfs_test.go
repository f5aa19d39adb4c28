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
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
)

type cpioEntry struct {
	mode         uint32
	data         string
	major, minor uint32
}

// readCpio parses a newc archive as the kernel does.
func readCpio(t *testing.T, b []byte) map[string]cpioEntry {
	t.Helper()
	out := map[string]cpioEntry{}
	off := 0
	align := func() { off = (off + 3) &^ 3 }
	field := func(i int) uint32 {
		v, err := strconv.ParseUint(string(b[off+6+8*i:off+6+8*i+8]), 16, 32)
		if err != nil {
			t.Fatalf("bad header field at %d: %v", off, err)
		}
		return uint32(v)
	}
	for {
		if off+110 > len(b) || string(b[off:off+6]) != "070701" {
			t.Fatalf("bad magic at offset %d", off)
		}
		mode, size, rmaj, rmin, nsize := field(1), field(6), field(9), field(10), field(11)
		name := string(b[off+110 : off+110+int(nsize)-1])
		off += 110 + int(nsize)
		align()
		data := string(b[off : off+int(size)])
		off += int(size)
		align()
		if name == "TRAILER!!!" {
			break
		}
		if _, dup := out[name]; dup {
			t.Errorf("duplicate entry %s", name)
		}
		out[name] = cpioEntry{mode: mode, data: data, major: rmaj, minor: rmin}
	}
	if len(b)%512 != 0 {
		t.Errorf("archive size %d is not a multiple of 512", len(b))
	}
	for _, c := range b[off:] {
		if c != 0 {
			t.Fatalf("garbage after trailer")
		}
	}
	return out
}

func TestBuildInitramfs(t *testing.T) {
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("no busybox:", err)
	}
	dir := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(dir, "tree/sub"), 0o755))
	must(os.WriteFile(filepath.Join(dir, "tree/a.txt"), []byte("aaa"), 0o644))
	must(os.WriteFile(filepath.Join(dir, "tree/sub/run.sh"), []byte("#!/bin/sh\n"), 0o755))
	must(os.WriteFile(filepath.Join(dir, "one"), []byte("x"), 0o600))
	must(os.WriteFile(filepath.Join(dir, "fake.ko"), []byte("ko"), 0o644))

	cfg := &Config{
		Busybox: bb,
		Files: map[string]string{
			"/data/tree":    filepath.Join(dir, "tree"),
			"/bin/one":      filepath.Join(dir, "one"),
			"/lib/x/../y/z": filepath.Join(dir, "one"),
		},
		Modules: []string{filepath.Join(dir, "fake.ko") + " a=1 b=2"},
		Env:     map[string]string{"FOO": "it's"},
		Cmd:     "echo hi",
	}
	if p, err := exec.LookPath("mkfs.ext4"); err == nil {
		cfg.Tools = []string{p}
	}
	dst := filepath.Join(dir, "initrd")
	must(buildInitramfs(dst, cfg, "NONCE"))
	b, err := os.ReadFile(dst)
	must(err)
	ents := readCpio(t, b)

	// Every entry's parent directory precedes it: sorted order.
	var names []string
	for n := range ents {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if d := filepath.Dir(n); d != "." {
			if e, ok := ents[d]; !ok || e.mode&0o170000 != sIFDIR {
				t.Errorf("%s: parent %s missing or not a directory", n, d)
			}
		}
	}

	check := func(name string, mode uint32, data string) {
		t.Helper()
		e, ok := ents[name]
		if !ok {
			t.Errorf("missing %s", name)
			return
		}
		if e.mode != mode {
			t.Errorf("%s: mode %o, want %o", name, e.mode, mode)
		}
		if data != "" && e.data != data {
			t.Errorf("%s: data %q, want %q", name, e.data, data)
		}
	}
	check("data/tree/a.txt", sIFREG|0o644, "aaa")
	check("data/tree/sub/run.sh", sIFREG|0o755, "#!/bin/sh\n")
	check("usr/bin/one", sIFREG|0o600, "x")
	check("usr/lib/y/z", sIFREG|0o600, "x")
	check("bin", sIFLNK|0o777, "usr/bin")
	check("lib64", sIFLNK|0o777, "usr/lib64")
	check("usr/bin/sh", sIFLNK|0o777, guestBusybox)
	check("usr/bin/busybox", sIFREG|0o755, "")
	check("tmp", sIFDIR|0o1777, "")
	check("init", sIFREG|0o755, "")
	check("etc/mpnbd-vm/payload", sIFREG|0o755, "echo hi\n")
	check("etc/mpnbd-vm/env", sIFREG|0o644, "export FOO='it'\\''s'\n")
	check("etc/mpnbd-vm/modules", sIFREG|0o644, guestModulesDir+"/00-fake.ko a=1 b=2\n")
	check(strings.TrimPrefix(guestModulesDir, "/")+"/00-fake.ko", sIFREG|0o644, "ko")
	if c := ents["dev/console"]; c.mode != sIFCHR|0o600 || c.major != 5 || c.minor != 1 {
		t.Errorf("dev/console = %+v", c)
	}
	if !strings.Contains(ents["init"].data, "MPNBD-VM-EXIT-NONCE=") {
		t.Errorf("init lacks the nonce marker")
	}
	if len(cfg.Tools) > 0 {
		// The tool wins over busybox's applet, and its libraries and the
		// dynamic loader come along.
		check("usr/sbin/mkfs.ext4", sIFREG|0o755, "")
		if _, ok := ents["usr/lib64/ld-linux-x86-64.so.2"]; !ok {
			t.Errorf("dynamic loader missing")
		}
		if _, ok := ents["usr/lib/x86_64-linux-gnu/libext2fs.so.2"]; !ok {
			t.Errorf("libext2fs missing")
		}
	}
	// Applets are links to busybox.
	if e := ents["usr/bin/mount"]; e.mode != sIFLNK|0o777 || e.data != guestBusybox {
		t.Errorf("usr/bin/mount = %+v", e)
	}

	// An independent reader agrees.
	if _, err := exec.LookPath("cpio"); err == nil {
		cmd := exec.Command("cpio", "-it", "--quiet")
		cmd.Stdin = bytes.NewReader(b)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("cpio -it: %v", err)
		}
		if got := strings.Count(string(out), "\n"); got != len(ents) {
			t.Errorf("cpio lists %d entries, parsed %d", got, len(ents))
		}
	}
}

func TestCanon(t *testing.T) {
	for in, want := range map[string]string{
		"/bin/sh":             "/usr/bin/sh",
		"/sbin/ip":            "/usr/sbin/ip",
		"/lib/x/libc.so":      "/usr/lib/x/libc.so",
		"/lib64/ld.so":        "/usr/lib64/ld.so",
		"/library":            "/library",
		"/usr/bin/../sbin/tc": "/usr/sbin/tc",
		"/etc//x/":            "/etc/x",
	} {
		if got, err := canon(in); err != nil || got != want {
			t.Errorf("canon(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"rel", "/", ""} {
		if _, err := canon(bad); err == nil {
			t.Errorf("canon(%q) succeeded", bad)
		}
	}
}

func TestConsoleMarkers(t *testing.T) {
	var streamed bytes.Buffer
	c := newConsole("N", &streamed)
	input := "[    1.0] kernel says hi\r\nMPNBD-VM-START-N\r\nhello\r\nMPNBD-VM-EXIT-X=9\r\nworld\r\n[  2.0] oops MPNBD-VM-EXIT-N=42\r\n[ 3.0] reboot: Power down\r\n"
	// Feed in awkward chunks.
	for i := 0; i < len(input); i += 7 {
		if _, err := c.Write([]byte(input[i:min(i+7, len(input))])); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-c.exited:
	default:
		t.Fatal("exit marker not noticed")
	}
	c.flush()
	code, ok, setupErr := c.status()
	if !ok || code != 42 || setupErr != "" {
		t.Errorf("status = %d %v %q", code, ok, setupErr)
	}
	log, out := c.logs()
	if strings.Contains(log, "\r") {
		t.Errorf("log has carriage returns")
	}
	if want := "hello\nMPNBD-VM-EXIT-X=9\nworld\n[  2.0] oops "; out != want {
		t.Errorf("output = %q, want %q", out, want)
	}
	if streamed.String() != input {
		t.Errorf("streamed output differs")
	}

	c = newConsole("N", nil)
	if _, err := c.Write([]byte("MPNBD-VM-SETUP-ERROR-N: insmod nbd.ko\nnot terminated")); err != nil {
		t.Fatal(err)
	}
	c.flush()
	if _, ok, setupErr := c.status(); ok || setupErr != "insmod nbd.ko" {
		t.Errorf("status = %v %q", ok, setupErr)
	}
	if log, out := c.logs(); out != log || !strings.HasSuffix(log, "not terminated\n") {
		t.Errorf("logs = %q %q", log, out)
	}
}

func TestTrimLog(t *testing.T) {
	var lines []string
	for i := range 100 {
		lines = append(lines, strconv.Itoa(i))
	}
	got := trimLog(strings.Join(lines, "\n"), 10)
	want := "0\n1\n... (90 lines omitted) ...\n92\n93\n94\n95\n96\n97\n98\n99"
	if got != want {
		t.Errorf("trimLog = %q", got)
	}
	if got := trimLog("a\nb\n", 10); got != "a\nb" {
		t.Errorf("trimLog short = %q", got)
	}
}
