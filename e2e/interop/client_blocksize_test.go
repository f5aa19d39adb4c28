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
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// wireRequest is one request as nbdkit's log filter saw it arrive.
type wireRequest struct {
	Cmd         string // Read, Write, Zero, Trim, Flush, Cache...
	Offset, Len uint64
	Line        string
}

var logRequest = regexp.MustCompile(`connection=\d+ (\w+) id=\d+ offset=0x([0-9a-f]+) count=0x([0-9a-f]+)`)

// requestLog reads the requests nbdkit's log filter records, in order.
type requestLog struct {
	path string
	seen int
}

// next returns the requests logged since the previous call.
func (l *requestLog) next(t *testing.T) []wireRequest {
	t.Helper()
	b, err := os.ReadFile(l.path)
	if err != nil {
		t.Fatalf("read nbdkit request log: %v", err)
	}
	lines := strings.Split(string(b), "\n")
	var out []wireRequest
	for _, line := range lines[min(l.seen, len(lines)):] {
		m := logRequest.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		off, _ := strconv.ParseUint(m[2], 16, 64)
		n, _ := strconv.ParseUint(m[3], 16, 64)
		out = append(out, wireRequest{Cmd: m[1], Offset: off, Len: n, Line: strings.TrimSpace(line)})
	}
	l.seen = len(lines) - 1 // the last element is the unfinished line
	return out
}

// blockViolations lists requests that break the advertised constraints:
// offset and length must be multiples of the minimum block size, and the
// length of reads, writes, cache and write-zeroes requests may not exceed
// the maximum block size (NBD protocol, "Block size constraints").
func blockViolations(reqs []wireRequest, minBlock, maxBlock uint64) []string {
	var bad []string
	for _, r := range reqs {
		if r.Offset%minBlock != 0 || r.Len%minBlock != 0 {
			bad = append(bad, fmt.Sprintf("%s offset=%d length=%d is not aligned to the minimum block size %d  [%s]",
				r.Cmd, r.Offset, r.Len, minBlock, r.Line))
		}
		switch r.Cmd {
		case "Read", "Write", "Zero", "Cache":
			if r.Len > maxBlock {
				bad = append(bad, fmt.Sprintf("%s offset=%d length=%d exceeds the maximum block size %d  [%s]",
					r.Cmd, r.Offset, r.Len, maxBlock, r.Line))
			}
		}
	}
	return bad
}

// TestClientBlockSizeConstraints runs our client against nbdkit advertising
// block size constraints (minimum 512, preferred 4096, maximum 64 KiB) and
// enforcing them (blocksize-error-policy=error), with nbdkit's log filter
// recording every request exactly as it arrives from the client.
//
// Our client asks for NBD_INFO_BLOCK_SIZE in NBD_OPT_GO; the protocol then
// says it "MUST abide by the block size constraints it receives": offsets
// and lengths multiples of the minimum block size, and no read, write or
// write-zeroes request longer than the maximum block size. A call may
// still fail locally (the client refusing what it cannot express), but no
// violating request may reach the server.
func TestClientBlockSizeConstraints(t *testing.T) {
	needTools(t, "nbdkit")
	const (
		minBlock = 512
		maxBlock = 64 << 10
		size     = 4 << 20
	)
	logPath := filepath.Join(t.TempDir(), "requests.log")
	ps := startNbdkit(t, "unix", false, size, []string{"log", "blocksize-policy"}, []string{
		"logfile=" + logPath,
		"blocksize-error-policy=error",
		"blocksize-minimum=" + strconv.Itoa(minBlock),
		"blocksize-preferred=4096",
		"blocksize-maximum=" + strconv.Itoa(maxBlock),
	})
	// The subtests below report violations request by request; nbdkit's own
	// complaints about them add nothing.
	ps.expectErrors("request rejected")
	cl := dialClient(t, nbd.DialOptions{Network: "unix", Addr: ps.Addr})
	info := cl.Info()
	if info.MinBlock != minBlock || info.PrefBlock != 4096 || info.MaxBlock != maxBlock {
		t.Fatalf("client parsed block sizes %d/%d/%d, nbdkit advertises %d/4096/%d",
			info.MinBlock, info.PrefBlock, info.MaxBlock, minBlock, maxBlock)
	}
	reqs := &requestLog{path: logPath}
	reqs.next(t)
	want := make([]byte, size)

	checkWire := func(t *testing.T) {
		t.Helper()
		for _, v := range blockViolations(reqs.next(t), minBlock, maxBlock) {
			t.Errorf("client sent a request that violates the advertised constraints: %s", v)
		}
	}
	// refusedByServer fails the test when err is the server's error reply,
	// i.e. the violating request went out on the wire.
	refusedByServer := func(t *testing.T, what string, err error) bool {
		t.Helper()
		var nerr *nbd.Error
		if errors.As(err, &nerr) {
			t.Errorf("%s: the server refused the request with %s: the client sent it despite the advertised constraints", what, nbd.ErrnoName(nerr.Errno))
			return true
		}
		if err != nil {
			t.Logf("%s: refused locally: %v", what, err)
		}
		return false
	}

	t.Run("large-aligned-read-write-split-at-maximum", func(t *testing.T) {
		const off = 7 * minBlock
		p := randomBytes(42, 1<<20+3*minBlock)
		if _, err := cl.WriteAt(p, off); err != nil {
			t.Fatalf("write %d bytes at %d: %v", len(p), off, err)
		}
		copy(want[off:], p)
		got := make([]byte, len(p))
		if _, err := cl.ReadAt(got, off); err != nil {
			t.Fatalf("read %d bytes at %d: %v", len(got), off, err)
		}
		if !bytes.Equal(got, p) {
			t.Fatalf("read back differs: %s", firstDiff(got, p))
		}
		seen := reqs.next(t)
		if n := len(seen); n < 2*(len(p)+maxBlock-1)/maxBlock {
			t.Fatalf("nbdkit logged %d requests for a %d-byte write and read; want at least %d", n, len(p), 2*(len(p)+maxBlock-1)/maxBlock)
		}
		for _, v := range blockViolations(seen, minBlock, maxBlock) {
			t.Errorf("client sent a request that violates the advertised constraints: %s", v)
		}
	})

	t.Run("write-zeroes-split-at-maximum", func(t *testing.T) {
		const off, n = 1 << 20, 1 << 20
		err := cl.WriteZeroes(off, n, false)
		if !refusedByServer(t, "write zeroes", err) && err == nil {
			clear(want[off : off+n])
		}
		checkWire(t)
	})

	t.Run("unaligned-write", func(t *testing.T) {
		// Two bytes straddling the first sector boundary.
		p := []byte{0xa5, 0x5a}
		_, err := cl.WriteAt(p, minBlock-1)
		if !refusedByServer(t, "write of 2 bytes at 511", err) && err == nil {
			copy(want[minBlock-1:], p)
		}
		checkWire(t)
	})

	t.Run("unaligned-read", func(t *testing.T) {
		got := make([]byte, 100)
		_, err := cl.ReadAt(got, 1000)
		if !refusedByServer(t, "read of 100 bytes at 1000", err) && err == nil && !bytes.Equal(got, want[1000:1100]) {
			t.Errorf("unaligned read returned wrong data: %s", firstDiff(got, want[1000:1100]))
		}
		checkWire(t)
	})

	// Whatever the client did, the export holds what the successful calls
	// wrote.
	if err := cl.Flush(); err != nil {
		t.Fatalf("flush: %v", err)
	}
	compareFile(t, ps.Path, want, "at the end")
}
