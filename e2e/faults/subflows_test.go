package faults

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// TestFuseSubflowsRestoredUnderKills: a fuse volume attached over 4 MPTCP
// paths while path 4 is cut runs on 3 subflows; once the path is back,
// its volume server process swaps in a connection with all 4 (a join the
// kernel never retries) while fio writes and verifies; then the storage
// server is SIGKILLed and restarted under fio again and again. Every fio
// round verifies with no I/O error, and the volume ends on 4 subflows.
// Real processes throughout: the storage server, the volume's server
// process, fio; this test's process is the client host (a network
// namespace of its own).
func TestFuseSubflowsRestoredUnderKills(t *testing.T) {
	need(t, "fio", "unshare")
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: %v", err)
	}
	if !topo.InFreshNetns(t) {
		return
	}
	cfg := topo.Default4(topo.UniqueName("fk"))
	cfg.ClientInCaller = true
	tp := topo.NewForTest(t, cfg)

	bin, err := buildOnce()
	if err != nil {
		t.Fatalf("build the commands: %v", err)
	}
	dir := t.TempDir()
	image := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(image, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(image, 256<<20); err != nil {
		t.Fatal(err)
	}
	const port = 10809
	s := &ourServer{bin: filepath.Join(bin, "nbd-server"), image: image, port: port, ns: tp.ServerNS, host: tp.ServerAddr(1).String()}
	s.start(t)
	t.Cleanup(func() { s.kill(t) })

	link := func(state string) {
		t.Helper()
		if out, err := exec.Command("ip", "-n", tp.ClientNS, "link", "set", tp.Paths[3].ClientIf, state).CombinedOutput(); err != nil {
			t.Fatalf("ip link set %s %s: %v: %s", tp.Paths[3].ClientIf, state, err, out)
		}
	}
	link("down")
	var addrs []string
	for i := range tp.Paths {
		addrs = append(addrs, net.JoinHostPort(tp.ServerAddr(i+1).String(), strconv.Itoa(port)))
	}
	a := fuse.New(fuse.Config{StateDir: t.TempDir()})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	att, err := a.Attach(ctx, attach.Target{VolumeID: "pv-subflows", Export: "disk", Addrs: addrs}, attach.Options{})
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := a.Detach(context.Background(), "pv-subflows"); err != nil {
			t.Errorf("detach: %v", err)
		}
	})
	health := func() attach.Health {
		t.Helper()
		h, err := a.Health("pv-subflows")
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	subflows := func(h attach.Health) int {
		if len(h.Subflows) != 1 {
			return 0
		}
		return h.Subflows[0]
	}
	time.Sleep(3 * time.Second)
	if h := health(); !h.MPTCP || subflows(h) != 3 {
		t.Fatalf("with path 4 cut: %+v, want MPTCP with 3 subflows", h)
	}

	// fio writes and verifies, round after round, through everything
	// that follows.
	stop := make(chan struct{})
	rounds := make(chan int, 1)
	failed := make(chan string, 1)
	go func() {
		n := 0
		defer func() { rounds <- n }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if out, err := fioVerify(t, att.Device, 32<<20, n+1); err != nil {
				failed <- "round " + strconv.Itoa(n+1) + ": " + err.Error() + "\n" + out
				return
			}
			n++
		}
	}()
	finish := func() int {
		close(stop)
		n := <-rounds
		select {
		case f := <-failed:
			t.Fatalf("fio: %s", f)
		default:
		}
		return n
	}

	link("up")
	// The keeper looks every 5 s and acts after 20 s short.
	deadline := time.Now().Add(90 * time.Second)
	for h := health(); subflows(h) != 4 || h.Replaced == 0; h = health() {
		if time.Now().After(deadline) {
			finish()
			t.Fatalf("90 s after path 4 came back: %+v, want 4 subflows after a swap", h)
		}
		select {
		case f := <-failed:
			t.Fatalf("fio: %s", f)
		case <-time.After(time.Second):
		}
	}
	t.Logf("all 4 subflows back by a swap %v after the path came back", time.Since(deadline.Add(-90*time.Second)).Round(time.Second))

	p := faultPlan()
	killStop := make(chan struct{})
	kills := killer(t, s, p, killStop)
	time.Sleep(p.duration)
	close(killStop)
	nk := <-kills
	n := finish()
	if nk == 0 {
		t.Fatal("the server was never killed: the run proves nothing")
	}
	deadline = time.Now().Add(30 * time.Second)
	for h := health(); subflows(h) != 4 || !h.Connected; h = health() {
		if time.Now().After(deadline) {
			t.Fatalf("after the kills: %+v, want connected on 4 subflows", h)
		}
		time.Sleep(500 * time.Millisecond)
	}
	h := health()
	t.Logf("%d fio write+verify rounds across the swap and %d SIGKILLs of the server: 0 I/O errors, 0 verify failures; %d swap(s), %d reconnects",
		n, nk, h.Replaced, h.Reconnects)
}
