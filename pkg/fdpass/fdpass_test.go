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

package fdpass

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// socketPair returns the two ends of a unix stream socket pair.
func socketPair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "socketpair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

func pipe(t *testing.T) (r, w *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close(); w.Close() })
	return r, w
}

// requireAllClosed fails unless every write end of the pipe of r is
// closed: a received copy left open keeps r from seeing the end.
func requireAllClosed(t *testing.T, r *os.File) {
	t.Helper()
	if err := r.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(r); err != nil {
		t.Fatalf("a copy of the pipe's write end is still open: %v", err)
	}
}

// sendRaw writes b with the descriptors of files attached, as a peer
// that frames by hand would.
func sendRaw(t *testing.T, c *net.UnixConn, b []byte, files ...*os.File) {
	t.Helper()
	var oob []byte
	if len(files) > 0 {
		fds := make([]int, len(files))
		for i, f := range files {
			fds[i] = int(f.Fd())
		}
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.WriteMsgUnix(b, oob, nil); err != nil {
		t.Fatal(err)
	}
}

// control runs fn on f's descriptor, leaving f as it is (f.Fd would make
// it blocking).
func control(t *testing.T, f *os.File, fn func(fd uintptr)) {
	t.Helper()
	raw, err := f.SyscallConn()
	if err == nil {
		err = raw.Control(fn)
	}
	if err != nil {
		t.Fatal(err)
	}
}

func header(n uint32) []byte { return binary.BigEndian.AppendUint32(nil, n) }

// fit is how many descriptors the control buffer of Recv with room for
// maxFiles holds (alignment may leave room for more).
func fit(maxFiles int) int {
	return (unix.CmsgSpace(maxFiles*4) - unix.CmsgLen(0)) / 4
}

func repeat(f *os.File, n int) []*os.File {
	fs := make([]*os.File, n)
	for i := range fs {
		fs[i] = f
	}
	return fs
}

type msg struct {
	Name  string `json:"name"`
	Files int    `json:"files,omitempty"`
}

func TestFilesArriveAndWork(t *testing.T) {
	a, b := socketPair(t)
	r, w := pipe(t)
	dl := time.Now().Add(5 * time.Second)
	if err := SendJSON(a, msg{Name: "one", Files: 1}, []*os.File{w}, dl); err != nil {
		t.Fatal(err)
	}
	// Sent as it is: still non-blocking, in the poller.
	control(t, w, func(fd uintptr) {
		if fl, err := unix.FcntlInt(fd, unix.F_GETFL, 0); err != nil || fl&unix.O_NONBLOCK == 0 {
			t.Errorf("the sent file's flags %#x, %v: Send made it blocking", fl, err)
		}
	})
	w.Close()
	var m msg
	files, err := RecvJSON(b, &m, 4, dl)
	if err != nil {
		t.Fatal(err)
	}
	if m != (msg{Name: "one", Files: 1}) || len(files) != 1 {
		t.Fatalf("received %+v with %d files", m, len(files))
	}
	got := files[0]
	control(t, got, func(fd uintptr) {
		if fl, err := unix.FcntlInt(fd, unix.F_GETFD, 0); err != nil || fl&unix.FD_CLOEXEC == 0 {
			t.Errorf("received descriptor flags %#x, %v: not close-on-exec", fl, err)
		}
	})
	if _, err := got.Write([]byte("through the socket")); err != nil {
		t.Fatal(err)
	}
	Close(files)
	if err := r.SetReadDeadline(dl); err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(r); err != nil || string(b) != "through the socket" {
		t.Fatalf("the pipe reads %q, %v", b, err)
	}
}

func TestMessagesWithoutFiles(t *testing.T) {
	a, b := socketPair(t)
	r, w := pipe(t)
	dl := time.Now().Add(5 * time.Second)
	// Back to back on the stream: each message keeps its own files; the
	// last one is larger than the socket's buffer.
	sent := make(chan error, 1)
	go func() {
		defer w.Close()
		for _, m := range []msg{{Name: "first"}, {Name: "with", Files: 1}, {Name: strings.Repeat("x", 1<<20)}} {
			var files []*os.File
			if m.Files > 0 {
				files = []*os.File{w}
			}
			if err := SendJSON(a, m, files, dl); err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	}()
	for i, want := range []int{0, 1, 0} {
		var m msg
		files, err := RecvJSON(b, &m, 4, dl)
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
		if len(files) != want || m.Files != want {
			t.Fatalf("message %d (%.10s) with %d files, want %d", i, m.Name, len(files), want)
		}
		Close(files)
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	requireAllClosed(t, r)
}

// The frame is the length, big-endian, then the JSON, the files with the
// length's bytes.
func TestWireFormat(t *testing.T) {
	a, b := socketPair(t)
	r, w := pipe(t)
	dl := time.Now().Add(5 * time.Second)
	if err := SendJSON(a, msg{Name: "wire", Files: 1}, []*os.File{w}, dl); err != nil {
		t.Fatal(err)
	}
	body := `{"name":"wire","files":1}`
	want := string(header(uint32(len(body)))) + body
	buf := make([]byte, 1024)
	oob := make([]byte, unix.CmsgSpace(4*4))
	b.SetReadDeadline(dl)
	n, oobn, _, _, err := b.ReadMsgUnix(buf, oob)
	if err != nil {
		t.Fatal(err)
	}
	if string(buf[:n]) != want {
		t.Fatalf("on the wire %q, want %q", buf[:n], want)
	}
	files, err := parseRights(oob[:oobn])
	if err != nil || len(files) != 1 {
		t.Fatalf("%d files, %v", len(files), err)
	}
	Close(files)

	// A hand-made frame, its length split across two writes, the files
	// with the first two bytes.
	hdr := header(uint32(len(body)))
	sendRaw(t, a, hdr[:2], w)
	if _, err := a.Write(append(hdr[2:], body...)); err != nil {
		t.Fatal(err)
	}
	w.Close()
	var m msg
	files, err = RecvJSON(b, &m, 4, dl)
	if err != nil || m.Name != "wire" || len(files) != 1 {
		t.Fatalf("received %+v with %d files, %v", m, len(files), err)
	}
	Close(files)
	requireAllClosed(t, r)
}

func TestSendRecvBytes(t *testing.T) {
	a, b := socketPair(t)
	r, w := pipe(t)
	dl := time.Now().Add(5 * time.Second)
	if err := Send(a, []byte("line\n"), []*os.File{w, w}, dl); err != nil {
		t.Fatal(err)
	}
	w.Close()
	buf := make([]byte, 64)
	n, files, err := Recv(b, buf, 2, dl)
	if err != nil || string(buf[:n]) != "line\n" || len(files) != 2 {
		t.Fatalf("received %q with %d files, %v", buf[:n], len(files), err)
	}
	Close(files)
	requireAllClosed(t, r)
	if err := Send(a, nil, []*os.File{r}, dl); err == nil {
		t.Fatal("files sent without bytes")
	}
	a.Close()
	if _, _, err := Recv(b, buf, 2, dl); !errors.Is(err, io.EOF) {
		t.Fatalf("after the peer closed: %v, want io.EOF", err)
	}
}

func TestMoreFilesThanExpected(t *testing.T) {
	const maxFiles = 1
	n := fit(maxFiles)
	if n <= maxFiles {
		t.Skipf("the control buffer for %d file holds no more", maxFiles)
	}
	a, b := socketPair(t)
	r, w := pipe(t)
	dl := time.Now().Add(5 * time.Second)
	if err := SendJSON(a, msg{Name: "many"}, repeat(w, n), dl); err != nil {
		t.Fatal(err)
	}
	w.Close()
	var m msg
	files, err := RecvJSON(b, &m, maxFiles, dl)
	if !errors.Is(err, ErrTooManyFiles) || files != nil {
		t.Fatalf("%d files, %v; want ErrTooManyFiles", len(files), err)
	}
	requireAllClosed(t, r)
}

// A control message cut short (MSG_CTRUNC) is an error, and the files
// that did fit are closed.
func TestTruncatedControlMessage(t *testing.T) {
	for _, maxFiles := range []int{0, 1, 2} {
		a, b := socketPair(t)
		r, w := pipe(t)
		dl := time.Now().Add(5 * time.Second)
		if err := Send(a, []byte("x"), repeat(w, fit(maxFiles)+2), dl); err != nil {
			t.Fatal(err)
		}
		w.Close()
		buf := make([]byte, 8)
		_, files, err := Recv(b, buf, maxFiles, dl)
		if !errors.Is(err, ErrTruncated) || files != nil {
			t.Fatalf("room for %d: %d files, %v; want ErrTruncated", maxFiles, len(files), err)
		}
		requireAllClosed(t, r)
	}
}

func TestDeadline(t *testing.T) {
	a, b := socketPair(t)
	start := time.Now()
	var m msg
	_, err := RecvJSON(b, &m, 1, time.Now().Add(50*time.Millisecond))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("nothing sent: %v, want a deadline error", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the deadline took %v", d)
	}

	// Expired with half a message and its file received.
	r, w := pipe(t)
	body := `{"name":"half"}`
	sendRaw(t, a, append(header(uint32(len(body))), body[:5]...), w)
	w.Close()
	_, err = RecvJSON(b, &m, 1, time.Now().Add(50*time.Millisecond))
	if !errors.Is(err, os.ErrDeadlineExceeded) || !strings.Contains(err.Error(), "message of 15 bytes") {
		t.Fatalf("half a message: %v, want a deadline error naming the message", err)
	}
	requireAllClosed(t, r)
}

func TestPeerClosesMidMessage(t *testing.T) {
	body := `{"name":"cut"}`
	for _, sent := range [][]byte{
		header(uint32(len(body)))[:2],
		append(header(uint32(len(body))), body[:4]...),
	} {
		a, b := socketPair(t)
		r, w := pipe(t)
		sendRaw(t, a, sent, w)
		w.Close()
		a.Close()
		var m msg
		files, err := RecvJSON(b, &m, 1, time.Now().Add(5*time.Second))
		if !errors.Is(err, io.ErrUnexpectedEOF) || files != nil {
			t.Fatalf("after %d bytes: %d files, %v; want io.ErrUnexpectedEOF", len(sent), len(files), err)
		}
		requireAllClosed(t, r)
	}
	a, b := socketPair(t)
	a.Close()
	var m msg
	if _, err := RecvJSON(b, &m, 1, time.Now().Add(5*time.Second)); !errors.Is(err, io.EOF) {
		t.Fatalf("closed before a message: %v, want io.EOF", err)
	}
}

func TestRefusedMessagesCloseTheirFiles(t *testing.T) {
	for name, frame := range map[string][]byte{
		"too large": header(MaxFrame + 1),
		"not json":  append(header(4), "nope"...),
	} {
		a, b := socketPair(t)
		r, w := pipe(t)
		sendRaw(t, a, frame, w)
		w.Close()
		var m msg
		files, err := RecvJSON(b, &m, 1, time.Now().Add(5*time.Second))
		if err == nil || files != nil {
			t.Fatalf("%s: %d files, %v", name, len(files), err)
		}
		if name == "too large" && !errors.Is(err, ErrTooLarge) {
			t.Fatalf("%s: %v, want ErrTooLarge", name, err)
		}
		requireAllClosed(t, r)
	}
	a, _ := socketPair(t)
	if err := SendJSON(a, strings.Repeat("x", MaxFrame), nil, time.Time{}); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("sending more than MaxFrame: %v, want ErrTooLarge", err)
	}
}
