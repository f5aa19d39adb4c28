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

package nodeattach

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/nbddev"
	"github.com/mpnbd/mpnbd/pkg/datapath"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nbd/nbdnl"
	"golang.org/x/sys/unix"
)

// writeDevice writes data at offset 0 of a block device in 1 MiB writes
// with O_DIRECT, then fsyncs.
func writeDevice(dev string, data []byte) error {
	f, err := os.OpenFile(dev, os.O_WRONLY|unix.O_DIRECT, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	buf := alignedBuf(1 << 20)
	for off := 0; off < len(data); off += len(buf) {
		n := copy(buf, data[off:])
		if _, err := f.WriteAt(buf[:n], int64(off)); err != nil {
			return err
		}
	}
	return f.Sync()
}

func readDevice(dev string, n int) ([]byte, error) {
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := make([]byte, 0, n)
	buf := alignedBuf(1 << 20)
	for off := 0; off < n; off += len(buf) {
		m, err := f.ReadAt(buf[:min(len(buf), n-off)], int64(off))
		if err != nil && err != io.EOF {
			return nil, err
		}
		out = append(out, buf[:m]...)
	}
	return out, nil
}

// alignedBuf returns a page-aligned buffer for O_DIRECT.
func alignedBuf(n int) []byte {
	b := make([]byte, n+4096)
	off := 4096 - int(uintptrOf(b)%4096)
	if off == 4096 {
		off = 0
	}
	return b[off : off+n]
}

// dialTCPFile dials the export from the client namespace, negotiates, and
// returns the socket as a file for the kernel.
func dialTCPFile(t *testing.T, tp *topo.Topology, st *storage) (*os.File, error) {
	var c net.Conn
	err := tp.InClient(func() error {
		var err error
		c, err = net.Dial("tcp", st.addr)
		return err
	})
	if err != nil {
		return nil, err
	}
	defer c.Close()
	if _, err := nbd.NegotiateConn(context.Background(), c, "vol"); err != nil {
		return nil, err
	}
	return c.(*net.TCPConn).File()
}

// childSpec is what the attaching child process is told.
type childSpec struct {
	Target   attach.Target
	StateDir string
	// Adopt makes the child find the volume from the state directory and
	// sysfs (as a restarted node plugin does) instead of attaching it.
	Adopt bool
	// Mode is the transport (relay when empty).
	Mode attach.Transport
	// Datapath makes the child a datapath component serving this socket:
	// it first takes the volumes over from a datapath already serving it
	// (printing TAKEN and their number), then attaches.
	Datapath string
}

// TestHelperAttachProcess is not a test: it is the attaching process
// (a node plugin's part) that TestReadoptAfterKill and the restart tests
// start and kill. It attaches (or re-adopts) the volume, prints the device
// and waits to be killed.
func TestHelperAttachProcess(t *testing.T) {
	spec := os.Getenv("MPNBD_ATTACH_CHILD")
	if spec == "" {
		t.Skip("helper process for TestReadoptAfterKill")
	}
	var cs childSpec
	if err := json.Unmarshal([]byte(spec), &cs); err != nil {
		t.Fatal(err)
	}
	if cs.Mode == "" {
		cs.Mode = attach.Relay
	}
	var a interface {
		attach.Attacher
		attach.Adopter
	}
	if cs.Mode == attach.Ublk {
		// The caller's network namespace is the client's: the volume
		// processes stay in it.
		u, err := newUblkSupervisor("", cs.StateDir, testLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		a = u
	} else {
		nl, err := nbdnl.Dial()
		if err != nil {
			t.Fatal(err)
		}
		n, err := nbddev.New(nbddev.Config{
			Mode: cs.Mode, Kernel: nl, Devices: nbdnl.Sysfs{Root: "/sys"}, Logger: testLogger(t), StateDir: cs.StateDir,
		})
		if err != nil {
			t.Fatal(err)
		}
		a = n
	}
	var att *attach.Attachment
	var err error
	if cs.Datapath != "" {
		m := attach.NewManager(map[attach.Transport]attach.Attacher{cs.Mode: a}, testLogger(t))
		taken, err := datapath.TakeOver(context.Background(), cs.Datapath, m, testLogger(t))
		if err != nil {
			t.Fatalf("take over: %v", err)
		}
		fmt.Printf("TAKEN %d\n", len(taken))
		for _, a := range taken {
			if a.VolumeID == cs.Target.VolumeID {
				att = a
			}
		}
		if att == nil {
			if att, err = m.Attach(context.Background(), cs.Mode, cs.Target, attach.Options{}); err != nil {
				t.Fatal(err)
			}
		}
		go func() {
			if err := datapath.Serve(context.Background(), cs.Datapath, m, testLogger(t)); err != nil {
				t.Errorf("serve: %v", err)
			}
		}()
		waitDial(t, cs.Datapath)
	} else if cs.Adopt {
		atts, err := a.Adopt(context.Background())
		if err != nil || len(atts) != 1 {
			t.Fatalf("adopt: %v %v", atts, err)
		}
		att = atts[0]
	} else if att, err = a.Attach(context.Background(), cs.Target, attach.Options{}); err != nil {
		t.Fatal(err)
	}
	os.Stdout.WriteString("ATTACHED " + att.Device + "\n")
	select {}
}

func startChild(t *testing.T, cs childSpec) (*exec.Cmd, string) {
	t.Helper()
	cmd, dev, _ := startChildTaken(t, cs)
	return cmd, dev
}

// startChildTaken starts the child and returns, besides its device, the
// number of volumes it took over from a datapath (-1 if it said nothing).
func startChildTaken(t *testing.T, cs childSpec) (*exec.Cmd, string, int) {
	t.Helper()
	cmd, ch := startChildAsync(t, cs)
	s, ok := awaitChild(t, ch, 2*time.Minute)
	if !ok {
		t.Fatal("attaching process did not attach in time")
	}
	return cmd, s.dev, s.taken
}

// childSaid is what a child reported once it attached.
type childSaid struct {
	dev   string
	taken int
}

// startChildAsync starts the child; its report arrives on the channel,
// which is closed without one if the child exits first.
func startChildAsync(t *testing.T, cs childSpec) (*exec.Cmd, <-chan childSaid) {
	t.Helper()
	spec, _ := json.Marshal(cs)
	// The child runs on the client host, as this process does (see
	// guestTopology).
	argv := []string{os.Args[0], "-test.run=^TestHelperAttachProcess$", "-test.v"}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), "MPNBD_ATTACH_CHILD="+string(spec))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	ch := make(chan childSaid, 1)
	go func() {
		taken := -1
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			line := sc.Text()
			if strings.Contains(line, "_test.go:") || strings.HasPrefix(line, "---") || strings.HasPrefix(line, "panic") {
				// What the child's test says (a Fatal on the way) shows here.
				fmt.Println("    child:", line)
			}
			_, _ = fmt.Sscanf(line, "TAKEN %d", &taken) // most lines are not that one
			if d, ok := strings.CutPrefix(line, "ATTACHED "); ok {
				ch <- childSaid{d, taken}
			}
		}
		close(ch)
	}()
	return cmd, ch
}

// awaitChild waits up to d for a child's report; ok is false if none came
// in time. A child that exits without attaching fails the test.
func awaitChild(t *testing.T, ch <-chan childSaid, d time.Duration) (childSaid, bool) {
	t.Helper()
	select {
	case s, ok := <-ch:
		if !ok {
			t.Fatal("attaching process exited without attaching")
		}
		return s, true
	case <-time.After(d):
		return childSaid{}, false
	}
}

// waitDial waits for a unix socket to answer.
func waitDial(t *testing.T, path string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.Dial("unix", path)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s does not answer: %v", path, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestReadoptAfterKill kills the attaching process while a writer runs; a
// new process re-adopts the device by its backend identifier within the
// dead-connection timeout, and the writer sees no error.
func TestReadoptAfterKill(t *testing.T) {
	requireGuest(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, volSize, true)
	cs := childSpec{Target: st.target(volID(t)), StateDir: t.TempDir()}
	t0 := time.Now()
	first, dev := startChild(t, cs)
	t.Logf("%v: attached %s", time.Since(t0).Round(time.Millisecond), dev)

	data := make([]byte, dataSize)
	rand.Read(data)
	errc := make(chan error, 1)
	go func() { errc <- writeDevice(dev, data) }()
	time.Sleep(500 * time.Millisecond)
	first.Process.Kill()
	first.Wait()
	time.Sleep(500 * time.Millisecond)
	t.Logf("%v: first attaching process killed", time.Since(t0).Round(time.Millisecond))
	cs.Adopt = true
	_, dev2 := startChild(t, cs)
	t.Logf("%v: re-adopted %s", time.Since(t0).Round(time.Millisecond), dev2)
	if dev2 != dev {
		t.Fatalf("re-adopted %s, want %s", dev2, dev)
	}
	select {
	case err := <-errc:
		if err != nil {
			t.Fatalf("writer saw an error across the restart: %v", err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("writer stuck after re-adoption")
	}
	t.Logf("%v: writer finished", time.Since(t0).Round(time.Millisecond))
	got, err := readDevice(dev, len(data))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("data differs after re-adoption")
	}
	nl, err := nbdnl.Dial()
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	if err := nl.Disconnect(indexOf(t, dev)); err != nil {
		t.Fatal(err)
	}
}
