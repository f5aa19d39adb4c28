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

package replica

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// The replica processes of the tests are this test binary, started with
// these variables set: it serves export "r" of the file at
// replicaHelperFile on replicaHelperAddr over MPTCP, and prints
// "listening" once it does.
const (
	replicaHelperFile = "REPLICA_HELPER_FILE"
	replicaHelperAddr = "REPLICA_HELPER_ADDR"
	netnsVolumeSize   = 16 << 20
)

func TestMain(m *testing.M) {
	if path := os.Getenv(replicaHelperFile); path != "" {
		os.Exit(serveReplica(path, os.Getenv(replicaHelperAddr)))
	}
	os.Exit(m.Run())
}

func serveReplica(path, addr string) int {
	b, err := nbd.OpenFile(path, netnsVolumeSize, true, false)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	srv := &nbd.Server{Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	if err := srv.AddExport(&nbd.Export{Name: "r", Backend: b}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ln, err := mptcp.Listen(context.Background(), "tcp4", addr, true)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("listening")
	if err := srv.Serve(ln); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// replicaHost is a storage host of its own (a network namespace joined to
// the primary's by two shaped paths) running a replica process.
type replicaHost struct {
	name string
	tp   *topo.Topology
	file string
	cmd  *exec.Cmd
}

func startReplicaHost(t *testing.T, name string) *replicaHost {
	t.Helper()
	h := &replicaHost{name: name, tp: topo.NewForTest(t, topo.Uniform(topo.UniqueName("rp"+name), 2, 1000)),
		file: filepath.Join(t.TempDir(), name+".img")}
	h.start(t)
	return h
}

// start runs the replica process over h's file (again, after a kill).
func (h *replicaHost) start(t *testing.T) {
	t.Helper()
	addr := net.JoinHostPort(h.tp.ServerAddr(1).String(), "10809")
	cmd := topo.Exec(h.tp.ServerNS, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), replicaHelperFile+"="+h.file, replicaHelperAddr+"="+addr)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h.cmd = cmd
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	ready := make(chan bool, 1)
	go func() {
		line, _ := bufio.NewReader(out).ReadString('\n')
		ready <- strings.TrimSpace(line) == "listening"
		_, _ = io.Copy(io.Discard, out)
	}()
	select {
	case ok := <-ready:
		if !ok {
			t.Fatalf("replica %s did not start: %s", h.name, stderr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("replica %s not listening after 20 s: %s", h.name, stderr.String())
	}
}

// dial connects the primary to the replica, from the primary's side of
// the replica's paths, over MPTCP.
func (h *replicaHost) dial(t *testing.T) *nbd.Client {
	t.Helper()
	var cl *nbd.Client
	err := h.tp.InClient(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var err error
		cl, err = nbd.Dial(ctx, nbd.DialOptions{Addr: net.JoinHostPort(h.tp.ServerAddr(1).String(), "10809"), Export: "r", MPTCP: true,
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		return err
	})
	if err != nil {
		t.Fatalf("dialing replica %s: %v", h.name, err)
	}
	if !slices.Contains(cl.MultipathTCP(), true) {
		t.Fatalf("the forward to replica %s is not carried by MPTCP", h.name)
	}
	return cl
}

// TestMirrorThroughReplicaFaults runs a writer (4 goroutines of random
// 4 KiB writes, a FLUSH every 32 writes each) against a primary that
// forwards to two replica processes on hosts of their own, over MPTCP,
// while in turn: replica c is SIGKILLed (its connections reset); its
// process is started again over its file and c is rebuilt under the
// writes; then replica b's host goes silent (every packet dropped, no
// reset: a host powered off), so the primary goes on with c alone, b out
// by a recorded decision. No write or FLUSH fails. After, the primary's
// copy and c's file equal what was acknowledged, and b's file holds every
// acknowledged write outside the chunks its dirty log says it lacks (the
// writes after the first fault go to the first quarter only, so the log
// cannot cover everything and the check bites).
func TestMirrorThroughReplicaFaults(t *testing.T) {
	topo.RequireRoot(t)
	topo.RequireNft(t)
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	hb, hc := startReplicaHost(t, "b"), startReplicaHost(t, "c")
	arb := &fakeArbiter{epoch: 1}
	localPath := filepath.Join(t.TempDir(), "primary.img")
	local, err := nbd.OpenFile(localPath, netnsVolumeSize, true, false)
	if err != nil {
		t.Fatal(err)
	}
	const deadline = 2 * time.Second
	m, err := New(Config{Local: local, Peers: map[string]Peer{"b": hb.dial(t), "c": hc.dial(t)}, Epoch: 1, Arbiter: arb,
		Deadline: deadline, LogDir: t.TempDir(), Logger: slog.New(slog.NewTextHandler(tLog{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()

	// The writer. Each goroutine owns the blocks i with i%4 == g, so the
	// model of what each block holds needs no ordering between them.
	const block = 4096
	nblocks := netnsVolumeSize / block
	model := make([][]byte, nblocks)
	var (
		mu       sync.Mutex
		span     = nblocks // blocks [0, span) are written
		longest  time.Duration
		failures []string
		writes   int
	)
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ctx.Err() == nil; i++ {
				mu.Lock()
				n := span / 4
				mu.Unlock()
				k, _ := rand.Int(rand.Reader, big.NewInt(int64(n)))
				blk := int(k.Int64())*4 + g
				data := make([]byte, block)
				rand.Read(data)
				start := time.Now()
				_, err := m.WriteAt(data, int64(blk)*block)
				if err == nil && i%32 == 31 {
					err = m.Sync()
				}
				took := time.Since(start)
				mu.Lock()
				longest = max(longest, took)
				if err != nil {
					failures = append(failures, fmt.Sprintf("block %d: %v", blk, err))
				} else {
					model[blk] = data
					writes++
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		}()
	}
	phase := func(what string, d time.Duration) {
		mu.Lock()
		before, pause := writes, longest
		longest = 0
		mu.Unlock()
		time.Sleep(d)
		mu.Lock()
		t.Logf("%s: %d writes, longest write or FLUSH %v", what, writes-before, longest.Round(time.Millisecond))
		longest = max(longest, pause)
		mu.Unlock()
	}
	phase("all in sync", 2*time.Second)
	mu.Lock()
	span = nblocks / 4
	mu.Unlock()

	if err := hc.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// waitDropped waits (bounded: a loaded machine may be slow to run
	// the drop) until the arbiter has recorded want dropped.
	waitDropped := func(what string, want ...string) {
		t.Helper()
		for end := time.Now().Add(20 * time.Second); !slices.Equal(arb.dropped(), want); {
			if time.Now().After(end) {
				t.Fatalf("dropped %v %s, want %v", arb.dropped(), what, want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	phase("replica c SIGKILLed", 2*time.Second)
	waitDropped("after c was killed", "c")

	// c's process comes back over its file and is rebuilt while the
	// writers go on.
	_ = hc.cmd.Wait()
	hc.start(t)
	rebuilt := make(chan error, 1)
	go func() {
		rebuilt <- m.Rebuild(context.Background(), "c", hc.dial(t), RebuildOptions{})
	}()
	select {
	case err := <-rebuilt:
		if err != nil {
			t.Fatalf("rebuilding c: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("c not rebuilt within 60 s")
	}
	phase("replica c rebuilt", time.Second)
	if got := m.InSync(); !slices.Equal(got, []string{"b", "c"}) {
		t.Fatalf("in sync after c's rebuild: %v, want [b c]", got)
	}

	if err := topo.Drop(hb.tp.ServerNS, "silent", ""); err != nil {
		t.Fatal(err)
	}
	phase("replica b's host silent", deadline+3*time.Second)
	waitDropped("after b's host went silent", "b")
	stop()
	wg.Wait()
	if len(failures) > 0 {
		t.Fatalf("%d writes or FLUSHes failed, the first: %s", len(failures), failures[0])
	}
	if got := arb.dropped(); !slices.Equal(got, []string{"b"}) || !slices.Equal(arb.rejoins, []string{"c"}) {
		t.Fatalf("dropped %v, rejoined %v; want [b] and [c]", got, arb.rejoins)
	}
	if m.Epoch() != 4 || !slices.Equal(m.InSync(), []string{"c"}) {
		t.Fatalf("epoch %d, in sync %v; want 4 and [c]", m.Epoch(), m.InSync())
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}

	// The copies against what was acknowledged.
	check := func(who, path string, lacks []nbd.Range) {
		t.Helper()
		img, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		lacking := func(off int64) bool {
			for _, r := range lacks {
				if off >= r.Off && off < r.Off+r.Len {
					return true
				}
			}
			return false
		}
		checked, wrong := 0, 0
		for i, want := range model {
			off := int64(i) * block
			if want == nil || lacking(off) {
				continue
			}
			checked++
			if !bytes.Equal(img[off:off+block], want) {
				wrong++
			}
		}
		if wrong > 0 {
			t.Errorf("%s: %d of %d acknowledged blocks outside what it lacks do not hold what was acknowledged", who, wrong, checked)
		}
		var lackBytes int64
		for _, r := range lacks {
			lackBytes += r.Len
		}
		t.Logf("%s: %d acknowledged blocks verified, %d KiB lacking", who, checked, lackBytes>>10)
		if lackBytes > netnsVolumeSize/2 {
			t.Errorf("%s lacks %d KiB of %d: a log that covers everything proves nothing", who, lackBytes>>10, netnsVolumeSize>>10)
		}
	}
	check("the primary", localPath, nil)
	// c, rebuilt and in sync, lacks nothing; b, silenced, lacks what its
	// log says.
	if m.Lacking("c") != nil {
		t.Fatal("c, back in sync, has a dirty log")
	}
	check("replica c (killed, restarted, rebuilt)", hc.file, nil)
	l := m.Lacking("b")
	if l == nil {
		t.Fatal("no dirty log for replica b")
	}
	check("replica b (silenced)", hb.file, l.Ranges())
}

// tLog sends log lines to the test's log.
type tLog struct{ t *testing.T }

func (w tLog) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
