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

package interop

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// transports are the ways a peer reaches our server: plain TCP, and MPTCP
// with the peer wrapped by mptcpize.
var transports = []struct {
	name  string
	mptcp bool
}{{"tcp", false}, {"mptcp", true}}

// peer returns the command line that runs tool, wrapped by mptcpize for
// the MPTCP transport.
func peer(mptcp bool, tool string, args ...string) (string, []string) {
	if mptcp {
		return "mptcpize", append([]string{"run", tool}, args...)
	}
	return tool, args
}

func needTransport(t *testing.T, mptcp bool) {
	t.Helper()
	if mptcp {
		needMPTCP(t)
	}
}

// nbdinfoExport is the per-export part of `nbdinfo --json`.
type nbdinfoExport struct {
	Name         string `json:"export-name"`
	Size         *int64 `json:"export-size"`
	IsReadOnly   *bool  `json:"is_read_only"`
	IsRotational *bool  `json:"is_rotational"`
	CanCache     *bool  `json:"can_cache"`
	CanDF        *bool  `json:"can_df"`
	CanFastZero  *bool  `json:"can_fast_zero"`
	CanFlush     *bool  `json:"can_flush"`
	CanFUA       *bool  `json:"can_fua"`
	CanMultiConn *bool  `json:"can_multi_conn"`
	CanTrim      *bool  `json:"can_trim"`
	CanZero      *bool  `json:"can_zero"`
	BlockMin     *int64 `json:"block_size_minimum"`
	BlockPref    *int64 `json:"block_size_preferred"`
	BlockMax     *int64 `json:"block_size_maximum"`
}

type nbdinfoOutput struct {
	Protocol   string          `json:"protocol"`
	TLS        *bool           `json:"TLS"`
	Structured *bool           `json:"structured"`
	Exports    []nbdinfoExport `json:"exports"`
}

func parseNbdinfo(t *testing.T, out string) nbdinfoOutput {
	t.Helper()
	var v nbdinfoOutput
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("nbdinfo --json printed invalid JSON: %v\n%s", err, out)
	}
	return v
}

// checkAnnounced compares what nbdinfo saw with the size and transmission
// flags our server announces for e.
func checkAnnounced(t *testing.T, got nbdinfoExport, e *nbd.Export) {
	t.Helper()
	flags := e.Flags()
	wantBool := func(field string, p *bool, want bool) {
		t.Helper()
		if p == nil {
			t.Errorf("export %s: nbdinfo did not report %s", e.Name, field)
		} else if *p != want {
			t.Errorf("export %s: nbdinfo %s = %v, server announces %v (flags %#04x)", e.Name, field, *p, want, flags)
		}
	}
	if got.Name != e.Name {
		t.Errorf("export-name = %q, want %q", got.Name, e.Name)
	}
	if got.Size == nil || *got.Size != e.Backend.Size() {
		t.Errorf("export %s: export-size = %v, want %d", e.Name, deref(got.Size), e.Backend.Size())
	}
	wantBool("is_read_only", got.IsReadOnly, flags&nbd.FlagReadOnly != 0)
	wantBool("is_rotational", got.IsRotational, flags&nbd.FlagRotational != 0)
	wantBool("can_flush", got.CanFlush, flags&nbd.FlagSendFlush != 0)
	wantBool("can_fua", got.CanFUA, flags&nbd.FlagSendFUA != 0)
	wantBool("can_trim", got.CanTrim, flags&nbd.FlagSendTrim != 0)
	wantBool("can_zero", got.CanZero, flags&nbd.FlagSendWriteZeroes != 0)
	wantBool("can_multi_conn", got.CanMultiConn, flags&nbd.FlagCanMultiConn != 0)
	wantBool("can_df", got.CanDF, false)
	wantBool("can_cache", got.CanCache, false)
	wantBool("can_fast_zero", got.CanFastZero, false)
	// The server answers NBD_INFO_BLOCK_SIZE with 1 / 4096 / MaxRequestSize.
	for _, b := range []struct {
		field string
		p     *int64
		want  int64
	}{
		{"block_size_minimum", got.BlockMin, 1},
		{"block_size_preferred", got.BlockPref, 4096},
		{"block_size_maximum", got.BlockMax, nbd.MaxRequestSize},
	} {
		if b.p == nil || *b.p != b.want {
			t.Errorf("export %s: %s = %v, want %d", e.Name, b.field, deref(b.p), b.want)
		}
	}
}

func deref[T any](p *T) any {
	if p == nil {
		return "<missing>"
	}
	return *p
}

// TestNbdinfo checks that libnbd's nbdinfo sees exactly what our server
// announces, for a writable and a read-only export, and lists both.
func TestNbdinfo(t *testing.T) {
	needTools(t, "nbdinfo")
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			needTransport(t, tr.mptcp)
			ts := startServer(t, serverOptions{MPTCP: tr.mptcp},
				exportSpec{Name: "disk", Size: 40<<20 + 3*4096},
				exportSpec{Name: "golden", Size: 1<<20 + 7, ReadOnly: true, Fill: randomBytes(1, 1<<20+7)},
			)
			for _, name := range []string{"disk", "golden"} {
				cmd, args := peer(tr.mptcp, "nbdinfo", "--no-content", "--json", ts.URI(name))
				info := parseNbdinfo(t, mustRun(t, cmd, args...))
				if info.Protocol != "newstyle-fixed" {
					t.Errorf("protocol = %q, want newstyle-fixed", info.Protocol)
				}
				if info.TLS != nil && *info.TLS {
					t.Errorf("nbdinfo reports TLS, which the server never offers")
				}
				if info.Structured != nil && *info.Structured {
					t.Errorf("nbdinfo reports structured replies, which the server never agrees to")
				}
				if len(info.Exports) != 1 {
					t.Fatalf("nbdinfo reported %d exports, want 1: %+v", len(info.Exports), info.Exports)
				}
				got := info.Exports[0]
				checkAnnounced(t, got, ts.Exports[name])
				if ro := ts.Exports[name].ReadOnly; got.IsReadOnly == nil || *got.IsReadOnly != ro {
					t.Errorf("export %s: nbdinfo is_read_only = %v, want %v", name, deref(got.IsReadOnly), ro)
				}
			}

			cmd, args := peer(tr.mptcp, "nbdinfo", "--no-content", "--list", "--json", "nbd://"+ts.Addr)
			list := parseNbdinfo(t, mustRun(t, cmd, args...))
			var names []string
			for _, e := range list.Exports {
				names = append(names, e.Name)
				if exp, ok := ts.Exports[e.Name]; ok {
					checkAnnounced(t, e, exp)
				}
			}
			slices.Sort(names)
			if !slices.Equal(names, []string{"disk", "golden"}) {
				t.Errorf("nbdinfo --list shows exports %q, want [disk golden]", names)
			}

			// The plain-text listing too.
			cmd, args = peer(tr.mptcp, "nbdinfo", "--no-content", "--list", "nbd://"+ts.Addr)
			text := mustRun(t, cmd, args...)
			for _, name := range []string{"disk", "golden"} {
				if !strings.Contains(text, `export="`+name+`"`) {
					t.Errorf("nbdinfo --list output lacks export %q:\n%s", name, text)
				}
			}
			ts.checkTransport(t, tr.mptcp)
		})
	}
}

// TestNbdcopy copies a 64 MiB image with holes into an export that holds
// other data, then back out, with one and with four connections.
func TestNbdcopy(t *testing.T) {
	needTools(t, "nbdcopy")
	const size = 64 << 20
	cases := []struct {
		name    string
		mptcp   bool
		conns   int
		reqSize int // nbdcopy --request-size; 0 keeps its default (256 KiB)
	}{
		{"tcp/conns=1", false, 1, 0},
		{"tcp/conns=4", false, 4, 0},
		// Requests of exactly the largest size the server accepts.
		{"tcp/conns=2/request-size=32M", false, 2, nbd.MaxRequestSize},
		{"mptcp/conns=4", true, 4, 0},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			needTransport(t, tc.mptcp)
			// The export starts full of unrelated bytes, so the holes of the
			// source must be zeroed on the wire, not just skipped.
			ts := startServer(t, serverOptions{MPTCP: tc.mptcp},
				exportSpec{Name: "disk", Size: size, Fill: randomBytes(uint64(100+i), size)})
			dir := t.TempDir()
			src := filepath.Join(dir, "src.img")
			data := makeImage(t, src, uint64(200+i), size,
				region{Off: 8 << 20, Len: 4 << 20},
				region{Off: 30<<20 + 4096, Len: 1 << 20},
				region{Off: size - 2<<20, Len: 2 << 20})
			want := sum(data)
			// nbdcopy caps connections at its thread count (the number of
			// CPUs by default), so ask for as many threads.
			opts := []string{"--connections=" + strconv.Itoa(tc.conns), "--threads=" + strconv.Itoa(tc.conns)}
			if tc.reqSize > 0 {
				opts = append(opts, "--request-size="+strconv.Itoa(tc.reqSize), "--requests=4")
			}

			cmd, args := peer(tc.mptcp, "nbdcopy", append(opts, "--flush", src, ts.URI("disk"))...)
			mustRun(t, cmd, args...)
			if got := fileSum(t, ts.Paths["disk"]); got != want {
				t.Fatalf("backing file after nbdcopy in: sha256 %s, want %s (%s)",
					got, want, firstDiff(readFile(t, ts.Paths["disk"]), data))
			}

			back := filepath.Join(dir, "back.img")
			cmd, args = peer(tc.mptcp, "nbdcopy", append(opts, ts.URI("disk"), back)...)
			mustRun(t, cmd, args...)
			if got := fileSum(t, back); got != want {
				t.Fatalf("nbdcopy out: sha256 %s, want %s (%s)", got, want, firstDiff(readFile(t, back), data))
			}
			if ts.obs.count(nbd.CmdWrite) == 0 || ts.obs.count(nbd.CmdRead) == 0 {
				t.Fatalf("server saw no reads or writes: %s", ts.obs.summary())
			}
			// Each of the two copies opens its connections to the export.
			if n := ts.obs.transmissions(); n != 2*tc.conns {
				t.Errorf("server saw %d connections in transmission, want %d (%d per nbdcopy run)", n, 2*tc.conns, tc.conns)
			}
			ts.checkTransport(t, tc.mptcp)
		})
	}
}

// TestQemuImg checks qemu's NBD client: info, convert into the export and
// compare (including a deliberate mismatch, so compare is known to read).
func TestQemuImg(t *testing.T) {
	needTools(t, "qemu-img")
	const size = 32 << 20
	for i, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			needTransport(t, tr.mptcp)
			ts := startServer(t, serverOptions{MPTCP: tr.mptcp},
				exportSpec{Name: "vm", Size: size, Fill: randomBytes(uint64(300+i), size)})
			uri := ts.URI("vm")

			cmd, args := peer(tr.mptcp, "qemu-img", "info", "--output=json", uri)
			var info struct {
				VirtualSize *int64 `json:"virtual-size"`
				Format      string `json:"format"`
			}
			out := mustRun(t, cmd, args...)
			if err := json.Unmarshal([]byte(out), &info); err != nil {
				t.Fatalf("qemu-img info JSON: %v\n%s", err, out)
			}
			if info.VirtualSize == nil || *info.VirtualSize != size {
				t.Fatalf("qemu-img info virtual-size = %v, want %d\n%s", deref(info.VirtualSize), size, out)
			}
			if info.Format != "raw" {
				t.Errorf("qemu-img info format = %q, want raw", info.Format)
			}

			local := filepath.Join(t.TempDir(), "local.img")
			data := makeImage(t, local, uint64(400+i), size,
				region{Off: 4 << 20, Len: 4 << 20}, region{Off: 20<<20 + 512, Len: 64 << 10})
			// -m 16 -W: sixteen coroutines writing out of order.
			cmd, args = peer(tr.mptcp, "qemu-img", "convert", "-n", "-m", "16", "-W", "-f", "raw", "-O", "raw", local, uri)
			mustRun(t, cmd, args...)
			if got, want := fileSum(t, ts.Paths["vm"]), sum(data); got != want {
				t.Fatalf("backing file after qemu-img convert: sha256 %s, want %s (%s)",
					got, want, firstDiff(readFile(t, ts.Paths["vm"]), data))
			}

			cmd, args = peer(tr.mptcp, "qemu-img", "compare", "-f", "raw", "-F", "raw", local, uri)
			if out := mustRun(t, cmd, args...); !strings.Contains(out, "Images are identical") {
				t.Fatalf("qemu-img compare did not report identical images:\n%s", out)
			}

			// Flip one byte behind the server's back: compare must now see it
			// through the export.
			const off = 17<<20 + 12345
			f, err := os.OpenFile(ts.Paths["vm"], os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			_, err = f.WriteAt([]byte{data[off] ^ 0xff}, off)
			f.Close()
			if err != nil {
				t.Fatal(err)
			}
			r := runCmd(t, cmd, args...)
			// qemu-img reports the first differing 512-byte sector.
			if r.ExitCode != 1 || !strings.Contains(r.Stdout, "Content mismatch at offset "+strconv.Itoa(off&^511)+"!") {
				t.Fatalf("qemu-img compare after corrupting byte %d: exit %d (want 1, mismatch at %d)\nstdout:\n%s\nstderr:\n%s",
					off, r.ExitCode, off&^511, r.Stdout, r.Stderr)
			}
			ts.checkTransport(t, tr.mptcp)
		})
	}
}

// fioOutput is the part of fio's JSON report that is checked.
type fioOutput struct {
	Jobs []struct {
		Name  string      `json:"jobname"`
		Error int         `json:"error"`
		Read  fioDirStats `json:"read"`
		Write fioDirStats `json:"write"`
	} `json:"jobs"`
}

type fioDirStats struct {
	IOBytes int64 `json:"io_bytes"`
	IOs     int64 `json:"total_ios"`
}

// fioStderr drops the informational line fio's nbd engine always prints
// and returns whatever else fio wrote on stderr.
func fioStderr(s string) string {
	var rest []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" && l != "fio: connected to NBD server" {
			rest = append(rest, l)
		}
	}
	return strings.Join(rest, "\n")
}

// runFio runs fio with the nbd engine and returns its parsed JSON report
// along with the raw result; it does not judge the outcome.
func runFio(t *testing.T, mptcp bool, uri string, args ...string) (fioOutput, cmdResult) {
	t.Helper()
	base := []string{"--output-format=json", "--ioengine=nbd", "--uri=" + uri}
	name, argv := peer(mptcp, "fio", append(base, args...)...)
	r := runCmd(t, name, argv...)
	var out fioOutput
	if i := strings.Index(r.Stdout, "{"); i >= 0 {
		if err := json.Unmarshal([]byte(r.Stdout[i:]), &out); err != nil {
			t.Fatalf("fio printed invalid JSON: %v\nstdout:\n%s\nstderr:\n%s", err, r.Stdout, r.Stderr)
		}
	}
	for _, j := range out.Jobs {
		t.Logf("fio job %s: error %d, read %d B in %d ios, write %d B in %d ios",
			j.Name, j.Error, j.Read.IOBytes, j.Read.IOs, j.Write.IOBytes, j.Write.IOs)
	}
	return out, r
}

// mustFio runs fio and fails the test on a non-zero exit, a job error,
// anything unexpected on stderr or a report without jobs.
func mustFio(t *testing.T, mptcp bool, uri string, args ...string) fioOutput {
	t.Helper()
	out, r := runFio(t, mptcp, uri, args...)
	if r.Err != nil || r.ExitCode != 0 {
		t.Fatalf("fio failed (exit %d): %v\nstdout:\n%s\nstderr:\n%s", r.ExitCode, r.Err, r.Stdout, r.Stderr)
	}
	if e := fioStderr(r.Stderr); e != "" {
		t.Fatalf("fio complained on stderr:\n%s", e)
	}
	if len(out.Jobs) == 0 {
		t.Fatalf("fio reported no jobs:\n%s", r.Stdout)
	}
	for _, j := range out.Jobs {
		if j.Error != 0 {
			t.Fatalf("fio job %s: error %d\n%s", j.Name, j.Error, r.Stdout)
		}
	}
	return out
}

// TestFio drives the export with fio's nbd engine (libnbd, pipelined): a
// sequential write verified by CRC32C, a verify-only pass that must catch
// a byte flipped in the backing file, and a random read/write mix at queue
// depth 32.
func TestFio(t *testing.T) {
	needTools(t, "fio")
	const size = 64 << 20
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			needTransport(t, tr.mptcp)
			ts := startServer(t, serverOptions{MPTCP: tr.mptcp}, exportSpec{Name: "bench", Size: size})
			uri := ts.URI("bench")
			verifyJob := []string{"--name=verify", "--size=" + strconv.Itoa(size), "--rw=write", "--bs=64k", "--iodepth=16",
				"--verify=crc32c", "--do_verify=1", "--verify_fatal=1"}

			written := t.Run("write-verify", func(t *testing.T) {
				j := mustFio(t, tr.mptcp, uri, verifyJob...).Jobs[0]
				// The verify phase reads back everything written.
				if j.Write.IOBytes != size || j.Read.IOBytes != size {
					t.Fatalf("fio moved write=%d read=%d bytes, want %d each (the verify phase must read all)", j.Write.IOBytes, j.Read.IOBytes, size)
				}
			})

			t.Run("verify-catches-corruption", func(t *testing.T) {
				if !written {
					t.Skip("skipping: nothing verified was written")
				}
				// Flip one byte behind the server's back; a verify-only pass
				// over the same job must now fail, which shows that fio
				// compares what it reads through the server.
				const off = 12345678
				f, err := os.OpenFile(ts.Paths["bench"], os.O_RDWR, 0)
				if err != nil {
					t.Fatal(err)
				}
				var b [1]byte
				if _, err := f.ReadAt(b[:], off); err != nil {
					t.Fatal(err)
				}
				b[0] ^= 0xff
				_, err = f.WriteAt(b[:], off)
				f.Close()
				if err != nil {
					t.Fatal(err)
				}
				out, r := runFio(t, tr.mptcp, uri, append(verifyJob, "--verify_only")...)
				block := strconv.Itoa(off / (64 << 10) * (64 << 10))
				if r.ExitCode == 0 || len(out.Jobs) != 1 || out.Jobs[0].Error == 0 ||
					!strings.Contains(r.Stderr, "verify failed") || !strings.Contains(r.Stderr, "offset "+block) {
					t.Fatalf("verify-only fio over a corrupted block at %s: exit %d, want a verify failure there\nstdout:\n%s\nstderr:\n%s",
						block, r.ExitCode, r.Stdout, r.Stderr)
				}
			})

			t.Run("randrw-qd32", func(t *testing.T) {
				j := mustFio(t, tr.mptcp, uri, "--name=randrw", "--size="+strconv.Itoa(size), "--rw=randrw", "--rwmixread=50",
					"--bs=4k", "--iodepth=32", "--io_size=32m", "--randrepeat=1").Jobs[0]
				if j.Read.IOBytes <= 0 || j.Write.IOBytes <= 0 {
					t.Fatalf("fio moved read=%d write=%d bytes, want both > 0", j.Read.IOBytes, j.Write.IOBytes)
				}
				if total := j.Read.IOBytes + j.Write.IOBytes; total != 32<<20 {
					t.Errorf("fio moved %d bytes in total, want %d", total, 32<<20)
				}
			})
			if n := ts.obs.count(nbd.CmdWrite); n == 0 {
				t.Fatalf("server saw no writes: %s", ts.obs.summary())
			}
			ts.checkTransport(t, tr.mptcp)
		})
	}
}

// TestRefusals checks that libnbd understands our option error replies:
// an unknown export (NBD_REP_ERR_UNKNOWN, which libnbd maps to ENOENT), an
// export refused by policy (NBD_REP_ERR_POLICY) and a refused listing. The
// error message carried in each reply must reach libnbd intact.
func TestRefusals(t *testing.T) {
	needTools(t, "nbdinfo")
	ts := startServer(t, serverOptions{Deny: []string{"secret"}, DisableList: true},
		exportSpec{Name: "disk", Size: 1 << 20}, exportSpec{Name: "secret", Size: 1 << 20})

	for _, c := range []struct {
		name    string
		args    []string
		errno   string // how libnbd reports the reply type
		message string // the text our reply carries
	}{
		{"unknown export", []string{ts.URI("nosuch")}, "No such file or directory", "unknown export"},
		{"denied export", []string{ts.URI("secret")}, "server replied with error", "access denied"},
		{"listing disabled", []string{"--list", "nbd://" + ts.Addr}, "server replied with error to list request", "listing exports is disabled"},
	} {
		r := runCmd(t, "nbdinfo", c.args...)
		if r.Err == nil && r.ExitCode == 0 {
			t.Errorf("%s: nbdinfo succeeded, want failure\n%s", c.name, r.Stdout)
			continue
		}
		if r.ExitCode <= 0 {
			t.Errorf("%s: nbdinfo did not exit cleanly: exit %d, %v", c.name, r.ExitCode, r.Err)
		}
		t.Logf("%s: %s", c.name, strings.TrimSpace(r.Stderr))
		if !strings.Contains(r.Stderr, c.errno) {
			t.Errorf("%s: nbdinfo's error %q does not contain %q", c.name, r.Stderr, c.errno)
		}
		// libnbd's debug log shows the text carried by the error reply.
		r = runCmdEnv(t, []string{"LIBNBD_DEBUG=1"}, "nbdinfo", c.args...)
		if r.ExitCode <= 0 || !strings.Contains(r.Stderr, "server error message: "+c.message) {
			t.Errorf("%s: exit %d; libnbd did not receive the reply text %q; debug log:\n%s", c.name, r.ExitCode, c.message, r.Stderr)
		}
	}
	if n := ts.obs.transmissions(); n != 0 {
		t.Errorf("%d refused connections reached the transmission phase", n)
	}
	// The good export still works on the same server.
	info := parseNbdinfo(t, mustRun(t, "nbdinfo", "--no-content", "--json", ts.URI("disk")))
	checkAnnounced(t, info.Exports[0], ts.Exports["disk"])
}
