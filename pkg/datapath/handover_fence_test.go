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

package datapath

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// predecessorEnv makes this test binary a predecessor datapath serving
// the socket it names (see runPredecessor).
const predecessorEnv = "MPNBD_TEST_DATAPATH_PREDECESSOR"

func TestMain(m *testing.M) {
	if p := os.Getenv(predecessorEnv); p != "" {
		os.Exit(runPredecessor(p))
	}
	os.Exit(m.Run())
}

// runPredecessor serves volume v1 on the socket at path; its release never
// ends: it says "releasing" on standard output and waits to be killed.
func runPredecessor(path string) int {
	h := newHanding(nil, "v1")
	h.releasing = make(chan string, 1)
	h.releaseGate = make(chan struct{})
	go func() {
		<-h.releasing
		fmt.Println("releasing")
	}()
	ready := func() error {
		fmt.Println("ready")
		return nil
	}
	if err := ServeGeneration(context.Background(), path, h, quiet(), 0, ready); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// shortSteps makes the predecessor's wait for readiness d long.
func shortSteps(t *testing.T, d time.Duration) {
	old := stepTimeout
	stepTimeout = d
	t.Cleanup(func() { stepTimeout = old })
}

// secondServers records every volume succ starts while pred has not
// released it: a device with two servers.
func secondServers(pred, succ *handing) func() []string {
	var mu sync.Mutex
	var early []string
	succ.onStart = func(id string) {
		if _, released := pred.log(); !slices.Contains(released, id) {
			mu.Lock()
			early = append(early, id)
			mu.Unlock()
		}
	}
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(early)
	}
}

type takeResult struct {
	taken []*attach.Attachment
	err   error
}

func takeOverAsync(ctx context.Context, path string, succ *handing) chan takeResult {
	done := make(chan takeResult, 1)
	go func() {
		taken, err := TakeOver(ctx, path, succ, quiet())
		done <- takeResult{taken, err}
	}()
	return done
}

func awaitTake(t *testing.T, done chan takeResult) takeResult {
	t.Helper()
	select {
	case r := <-done:
		return r
	case <-time.After(30 * time.Second):
		t.Fatal("the takeover does not end")
		return takeResult{}
	}
}

// TestHandoverSlowReleaseHasOneServer: a predecessor alive but slow to
// release a volume (its release flushes through an outage, say) is
// waited for, however long past every step's timeout: the successor
// starts the volume only once it is released.
func TestHandoverSlowReleaseHasOneServer(t *testing.T) {
	shortSteps(t, 100*time.Millisecond)
	pred := newHanding(t, "v1")
	pred.releasing = make(chan string, 1)
	pred.releaseGate = make(chan struct{})
	path := servePredecessor(t, pred)
	succ := newHanding(t)
	early := secondServers(pred, succ)
	done := takeOverAsync(t.Context(), path, succ)
	select {
	case <-pred.releasing:
	case <-time.After(10 * time.Second):
		t.Fatal("the predecessor does not release the volume")
	}
	// Many times the step timeout: a successor that took a timeout for
	// a release would have started by now.
	time.Sleep(10 * stepTimeout)
	close(pred.releaseGate)
	r := awaitTake(t, done)
	if e := early(); len(e) > 0 {
		t.Fatalf("the successor started %v while the predecessor, alive, had not released it: two servers", e)
	}
	if r.err != nil || len(r.taken) != 1 {
		t.Fatalf("taken %v, %v; want v1", r.taken, r.err)
	}
}

// TestHandoverLateReadinessIsNoStart: a successor whose readiness comes
// after the predecessor gave up waiting for it (and serves the volume on)
// does not start the volume; a later round moves it.
func TestHandoverLateReadinessIsNoStart(t *testing.T) {
	shortSteps(t, 100*time.Millisecond)
	fastRetries(t, 50*time.Millisecond)
	pred := newHanding(t, "v1")
	path := servePredecessor(t, pred)
	succ := newHanding(t)
	early := secondServers(pred, succ)
	var once sync.Once
	succ.beforeTake = func(string) {
		// The first time, take until the predecessor has resumed.
		once.Do(func() {
			deadline := time.Now().Add(10 * time.Second)
			for {
				if resumed, _ := pred.log(); len(resumed) > 0 || time.Now().After(deadline) {
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	r := awaitTake(t, takeOverAsync(t.Context(), path, succ))
	if e := early(); len(e) > 0 {
		t.Fatalf("the successor started %v, which the predecessor serves on: two servers", e)
	}
	if resumed, _ := pred.log(); len(resumed) != 1 {
		t.Fatalf("the predecessor resumed %v; want v1, once", resumed)
	}
	if r.err != nil || len(r.taken) != 1 {
		t.Fatalf("taken %v, %v; want v1 in a later round", r.taken, r.err)
	}
}

// TestHandoverLivePredecessorHangingUpIsNoRelease: the end of the
// exchange after the readiness, from a predecessor that still runs, is no
// release: the successor does not start the volume.
func TestHandoverLivePredecessorHangingUpIsNoRelease(t *testing.T) {
	fastRetries(t, 50*time.Millisecond)
	old := exitGrace
	exitGrace = 200 * time.Millisecond
	t.Cleanup(func() { exitGrace = old })
	path := filepath.Join(t.TempDir(), "datapath.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: HandoverPath(path), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	// A predecessor of this very process: it hands v1 off, hears the
	// readiness, and hangs up without a verdict; then it stops listening.
	fake := make(chan error, 1)
	go func() {
		fake <- func() error {
			c, err := l.AcceptUnix()
			if err != nil {
				return err
			}
			defer c.Close()
			m, files, err := readMsg(c, 10*time.Second)
			closeAll(files)
			if err != nil {
				return err
			}
			if m.Liveness {
				pf, err := attach.SelfPidfd()
				if err != nil {
					return err
				}
				err = writeMsg(c, handoverMsg{Liveness: true}, []*os.File{pf})
				pf.Close()
				if err != nil {
					return err
				}
			}
			r, w, err := os.Pipe()
			if err != nil {
				return err
			}
			defer w.Close()
			ho := &attach.Handoff{VolumeID: "v1", Transport: attach.Relay, State: []byte(`{"k":1}`)}
			err = writeMsg(c, handoverMsg{Handoff: ho}, []*os.File{r})
			r.Close()
			if err != nil {
				return err
			}
			m, files, err = readMsg(c, 10*time.Second)
			closeAll(files)
			if err != nil || m.Ready == nil || !*m.Ready {
				return fmt.Errorf("readiness %+v, %v", m, err)
			}
			l.Close()
			return nil
		}()
	}()
	succ := newHanding(t)
	r := awaitTake(t, takeOverAsync(t.Context(), path, succ))
	if err := <-fake; err != nil {
		t.Fatal(err)
	}
	succ.mu.Lock()
	started := len(succ.started)
	succ.mu.Unlock()
	if started != 0 || len(r.taken) != 0 {
		t.Fatalf("the successor started %d volumes (taken %v) that a live predecessor never released: two servers", started, r.taken)
	}
}

func closeAll(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

// TestHandoverPredecessorKilledMidHandover: a predecessor SIGKILLed after
// the successor's readiness, before its release ends, serves nothing any
// more: the successor starts the volume (its pidfd says the predecessor
// exited).
func TestHandoverPredecessorKilledMidHandover(t *testing.T) {
	fastRetries(t, 50*time.Millisecond)
	path := filepath.Join(t.TempDir(), "datapath.sock")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), predecessorEnv+"="+path)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(waited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-waited
	})
	lines := make(chan string, 4)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	expect := func(want string) {
		t.Helper()
		select {
		case l := <-lines:
			if l != want {
				t.Fatalf("the predecessor says %q, want %q", l, want)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("the predecessor does not say %q", want)
		}
	}
	expect("ready")
	succ := newHanding(t)
	done := takeOverAsync(t.Context(), path, succ)
	expect("releasing")
	if err := cmd.Process.Signal(os.Kill); err != nil {
		t.Fatal(err)
	}
	r := awaitTake(t, done)
	succ.mu.Lock()
	_, started := succ.started["v1"]
	succ.mu.Unlock()
	if !started || len(r.taken) != 1 {
		t.Fatalf("after the predecessor's death mid-handover: taken %v, %v, started %v; want v1 started", r.taken, r.err, started)
	}
}
