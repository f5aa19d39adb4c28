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
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// handing is a fake data path whose volumes hand off a pipe: the
// successor proves it got the very file by reading what the test writes
// into the other end.
type handing struct {
	*fakeService
	mu       sync.Mutex
	pipes    map[string]*os.File // write ends, by volume
	refuse   map[string]int      // HandOff fails that many more times
	noTake   bool                // TakeHandoff fails
	resumed  []string
	released []string
	started  map[string]*os.File // successor: the files of started volumes
	// releasing, if set, hears a volume's name when its Release begins;
	// Release then waits for releaseGate, if set, to close.
	releasing   chan string
	releaseGate chan struct{}
	// onStart, if set, is called as a volume starts; beforeTake as
	// TakeHandoff begins.
	onStart    func(id string)
	beforeTake func(id string)
}

func newHanding(t *testing.T, vols ...string) *handing {
	h := &handing{fakeService: &fakeService{attached: map[string]attach.Transport{}}, pipes: map[string]*os.File{},
		refuse: map[string]int{}, started: map[string]*os.File{}}
	for _, v := range vols {
		h.attached[v] = attach.Relay
	}
	return h
}

func (h *handing) Volumes() map[string]attach.Transport {
	h.fakeService.mu.Lock()
	defer h.fakeService.mu.Unlock()
	out := map[string]attach.Transport{}
	for k, v := range h.attached {
		out[k] = v
	}
	return out
}

func (h *handing) HandOff(ctx context.Context, id string) (*attach.Handoff, error) {
	h.mu.Lock()
	refuse := h.refuse[id] > 0
	if refuse {
		h.refuse[id]--
	}
	h.mu.Unlock()
	if refuse {
		return nil, fmt.Errorf("%s: storage node away", id)
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	h.pipes[id] = w
	h.mu.Unlock()
	return &attach.Handoff{VolumeID: id, Transport: attach.Relay, State: []byte(`{"k":1}`), Files: []*os.File{r},
		Resume: func() error {
			h.mu.Lock()
			h.resumed = append(h.resumed, id)
			h.mu.Unlock()
			return nil
		},
		Release: func() {
			if h.releasing != nil {
				h.releasing <- id
			}
			if h.releaseGate != nil {
				<-h.releaseGate
			}
			h.mu.Lock()
			h.released = append(h.released, id)
			h.mu.Unlock()
			h.fakeService.mu.Lock()
			delete(h.attached, id)
			h.fakeService.mu.Unlock()
		}}, nil
}

func (h *handing) TakeHandoff(ctx context.Context, ho *attach.Handoff) (*attach.Attachment, error) {
	if h.beforeTake != nil {
		h.beforeTake(ho.VolumeID)
	}
	if h.noTake {
		for _, f := range ho.Files {
			f.Close()
		}
		return nil, errors.New("cannot take it")
	}
	if len(ho.Files) != 1 || string(ho.State) != `{"k":1}` {
		return nil, fmt.Errorf("handoff of %s: %d files, state %s", ho.VolumeID, len(ho.Files), ho.State)
	}
	f := ho.Files[0]
	ho.Start = func() error {
		if h.onStart != nil {
			h.onStart(ho.VolumeID)
		}
		h.mu.Lock()
		h.started[ho.VolumeID] = f
		h.mu.Unlock()
		return nil
	}
	ho.Abort = func() { f.Close() }
	return &attach.Attachment{VolumeID: ho.VolumeID}, nil
}

func (h *handing) log() (resumed, released []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.resumed...), append([]string(nil), h.released...)
}

func servePredecessor(t *testing.T, h *handing) string {
	t.Helper()
	return servePredecessorGen(t, h, 0)
}

func servePredecessorGen(t *testing.T, h *handing, gen int64) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "datapath.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ServeGeneration(ctx, path, h, quiet(), gen, nil) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("predecessor: %v", err)
			}
		case <-time.After(10 * time.Second):
			buf := make([]byte, 1<<20)
			t.Errorf("predecessor did not stop:\n%s", buf[:runtime.Stack(buf, true)])
		}
	})
	waitSocket(t, HandoverPath(path))
	return path
}

func waitSocket(t *testing.T, p string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if c, err := net.Dial("unix", p); err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s does not answer", p)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// fastRetries makes a successor ask again after d for what stayed.
func fastRetries(t *testing.T, d time.Duration) {
	old := retryInterval
	retryInterval = d
	t.Cleanup(func() { retryInterval = old })
}

// TestHandoverMovesVolumesWithTheirFiles: every volume moves with the very
// file it is held by; one that cannot quiesce at first (its storage node
// away) stays with the predecessor, which serves it on, calls included,
// until a later round moves it too.
func TestHandoverMovesVolumesWithTheirFiles(t *testing.T) {
	fastRetries(t, 300*time.Millisecond) // time for calls between the rounds
	pred := newHanding(t, "v1", "v2", "v3")
	pred.refuse["v2"] = 2
	path := servePredecessor(t, pred)
	succ := newHanding(t)
	// Between the rounds the predecessor answers the node plugin's calls
	// for the volume it kept.
	served := make(chan error, 1)
	go func() {
		c := &Client{Path: path}
		deadline := time.Now().Add(10 * time.Second)
		for {
			_, _, err := c.Health("v2")
			if err == nil || time.Now().After(deadline) {
				served <- err
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	taken, err := TakeOver(t.Context(), path, succ, quiet())
	if err != nil {
		t.Fatal(err)
	}
	if len(taken) != 3 {
		t.Fatalf("taken %v, want v1, v2 and v3", taken)
	}
	if err := <-served; err != nil {
		t.Fatalf("the predecessor did not serve calls for the volume it kept between the rounds: %v", err)
	}
	for _, id := range []string{"v1", "v2", "v3"} {
		succ.mu.Lock()
		f := succ.started[id]
		succ.mu.Unlock()
		if f == nil {
			t.Fatalf("%s not started", id)
		}
		msg := "through " + id
		pred.mu.Lock()
		w := pred.pipes[id]
		pred.mu.Unlock()
		if _, err := w.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		w.Close()
		b, err := io.ReadAll(f)
		if err != nil || string(b) != msg {
			t.Fatalf("%s: the successor's file reads %q, %v: not the predecessor's", id, b, err)
		}
	}
	if resumed, released := pred.log(); len(released) != 3 || len(resumed) != 0 {
		t.Fatalf("predecessor released %v, resumed %v", released, resumed)
	}
	if left := pred.Volumes(); len(left) != 0 {
		t.Fatalf("left with the predecessor: %v", left)
	}
	// The predecessor sends the node plugin on to the successor.
	c := &Client{Path: path}
	if _, _, err := c.Health("v2"); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("a call to the predecessor after the handover: %v, want ErrUnavailable", err)
	}
}

// TestHandoverSuccessorRefuses: a successor that cannot take a volume
// leaves it with the predecessor, and keeps asking instead of returning
// (its caller would adopt the volume next: two servers).
func TestHandoverSuccessorRefuses(t *testing.T) {
	fastRetries(t, 50*time.Millisecond)
	pred := newHanding(t, "v1")
	path := servePredecessor(t, pred)
	succ := newHanding(t)
	succ.noTake = true
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	taken, err := TakeOver(ctx, path, succ, quiet())
	if !errors.Is(err, context.DeadlineExceeded) || len(taken) != 0 {
		t.Fatalf("taken %v, %v; want nothing and the context's end", taken, err)
	}
	if resumed, released := pred.log(); len(resumed) < 2 || len(released) != 0 {
		t.Fatalf("predecessor resumed %v, released %v; want v1 resumed after each of several rounds", resumed, released)
	}
	if _, ok := pred.Volumes()["v1"]; !ok {
		t.Fatal("the volume left the predecessor")
	}
	// The last round may still be closing on the predecessor's side when
	// TakeOver returns: it serves again once it has seen the end.
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, _, err := (&Client{Path: path}).Health("v1")
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the predecessor does not serve calls for the volume it kept: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A successor that dies after it got a volume and before it said it was
// ready leaves the volume with the predecessor, which serves calls again.
func TestHandoverSuccessorDiesBeforeReady(t *testing.T) {
	pred := newHanding(t, "v1")
	path := servePredecessor(t, pred)
	nc, err := net.Dial("unix", HandoverPath(path))
	if err != nil {
		t.Fatal(err)
	}
	c := nc.(*net.UnixConn)
	if err := writeMsg(c, handoverMsg{Op: "handover"}, nil); err != nil {
		t.Fatal(err)
	}
	m, files, err := readMsg(c, 10*time.Second)
	if err != nil || m.Handoff == nil || len(files) != 1 {
		t.Fatalf("first message %+v, %d files, %v", m, len(files), err)
	}
	files[0].Close()
	c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		pred.mu.Lock()
		n := len(pred.resumed)
		pred.mu.Unlock()
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the predecessor did not resume the volume")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, released := pred.log(); len(released) != 0 {
		t.Fatalf("released %v", released)
	}
	cl := &Client{Path: path}
	var herr error
	for time.Now().Before(deadline) {
		if _, _, herr = cl.Health("v1"); herr == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if herr != nil {
		t.Fatalf("the predecessor does not serve calls again: %v", herr)
	}
}

func TestTakeOverWithoutPredecessor(t *testing.T) {
	taken, err := TakeOver(t.Context(), filepath.Join(t.TempDir(), "none.sock"), newHanding(t), quiet())
	if err != nil || taken != nil {
		t.Fatalf("%v, %v", taken, err)
	}
}

// A datapath of an older generation (an old pod's container restarted
// after its volumes went on) asks the newer one for them: refused, and
// the newer one serves on.
func TestHandoverRefusesAnOlderGeneration(t *testing.T) {
	pred := newHanding(t, "v1")
	path := servePredecessorGen(t, pred, 5)
	taken, err := TakeOverGeneration(t.Context(), path, 4, newHanding(t), quiet())
	if !errors.Is(err, ErrSuperseded) || len(taken) != 0 {
		t.Fatalf("an older datapath's takeover: %v, %v; want ErrSuperseded", taken, err)
	}
	if resumed, released := pred.log(); len(resumed)+len(released) != 0 {
		t.Fatalf("the newer datapath touched its volume: resumed %v, released %v", resumed, released)
	}
	if _, _, err := (&Client{Path: path}).Health("v1"); err != nil {
		t.Fatalf("the newer datapath stopped serving calls: %v", err)
	}
	// A later generation takes the volume.
	succ := newHanding(t)
	if taken, err := TakeOverGeneration(t.Context(), path, 6, succ, quiet()); err != nil || len(taken) != 1 {
		t.Fatalf("a newer datapath's takeover: %v, %v", taken, err)
	}
}

// The handover's messages are the same between datapaths of different
// releases: the length of the JSON (4 bytes, big-endian), then the JSON,
// the files attached to the length's bytes.
func TestHandoverWireFormat(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	var ends [2]*net.UnixConn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		ends[i] = c.(*net.UnixConn)
	}
	a, b := ends[0], ends[1]
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	frame := func(body string) []byte {
		return append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
	}

	if err := writeMsg(a, handoverMsg{Error: "v1: away"}, []*os.File{w}); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1024)
	oob := make([]byte, unix.CmsgSpace(4*4))
	b.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, oobn, _, _, err := b.ReadMsgUnix(buf, oob)
	if err != nil {
		t.Fatal(err)
	}
	if want := frame(`{"files":1,"error":"v1: away"}`); string(buf[:n]) != string(want) {
		t.Fatalf("on the wire %q, want %q", buf[:n], want)
	}
	cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(cmsgs) != 1 {
		t.Fatalf("control messages %v, %v", cmsgs, err)
	}
	got, err := unix.ParseUnixRights(&cmsgs[0])
	if err != nil || len(got) != 1 {
		t.Fatalf("descriptors %v, %v", got, err)
	}
	unix.Close(got[0])

	// A request as the first datapaths wrote it: frame and file at once.
	oob = unix.UnixRights(int(w.Fd()))
	if _, _, err := a.WriteMsgUnix(frame(`{"op":"handover","files":1,"generation":7}`), oob, nil); err != nil {
		t.Fatal(err)
	}
	m, files, err := readMsg(b, 10*time.Second)
	if err != nil || m.Op != "handover" || m.Generation != 7 || len(files) != 1 {
		t.Fatalf("read %+v with %d files, %v", m, len(files), err)
	}
	files[0].Close()

	// A message whose files are not the ones it announces is refused,
	// its files closed.
	if _, _, err := a.WriteMsgUnix(frame(`{"done":true}`), oob, nil); err != nil {
		t.Fatal(err)
	}
	if m, files, err := readMsg(b, 10*time.Second); err == nil || files != nil {
		t.Fatalf("read %+v with %d files, %v; want an error", m, len(files), err)
	}
	w.Close()
	if err := r.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(r); err != nil {
		t.Fatalf("a received copy of the pipe's write end is still open: %v", err)
	}
}
