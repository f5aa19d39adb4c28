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

//go:build linux

package nbdnl

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/genetlink/genltest"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

var testFamily = genetlink.Family{
	ID:      0x24,
	Name:    familyName,
	Version: familyVersion,
	Groups:  []genetlink.MulticastGroup{{ID: 9, Name: mcastGroup}},
}

// testClient returns a Client whose kernel is fn.
func testClient(t *testing.T, fn genltest.Func) *Client {
	t.Helper()
	c, err := newClient(genltest.Dial(genltest.ServeFamily(testFamily, fn)))
	if err != nil {
		t.Fatalf("newClient: %v", err)
	}
	c.sys = Sysfs{Root: t.TempDir()}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// ack stands in for the kernel's acknowledgement of a command without reply.
func ack() []genetlink.Message { return []genetlink.Message{{}} }

func checkHeader(t *testing.T, greq genetlink.Message, nreq netlink.Message, cmd uint8, flags netlink.HeaderFlags) {
	t.Helper()
	if greq.Header.Command != cmd || greq.Header.Version != familyVersion {
		t.Errorf("genl header %+v, want command %d version %d", greq.Header, cmd, familyVersion)
	}
	if nreq.Header.Type != netlink.HeaderType(testFamily.ID) {
		t.Errorf("netlink type %#x, want family %#x", nreq.Header.Type, testFamily.ID)
	}
	if nreq.Header.Flags != flags {
		t.Errorf("netlink flags %v, want %v", nreq.Header.Flags, flags)
	}
}

func pipeFiles(t *testing.T) (*os.File, *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close(); w.Close() })
	return r, w
}

func socketFile(t *testing.T, proto int) *os.File {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		t.Skipf("socket(AF_INET, SOCK_STREAM, %d): %v", proto, err)
	}
	f := os.NewFile(uintptr(fd), "socket")
	t.Cleanup(func() { f.Close() })
	return f
}

func TestConnectAllOptions(t *testing.T) {
	s1, s2 := pipeFiles(t)
	c := testClient(t, func(greq genetlink.Message, nreq netlink.Message) ([]genetlink.Message, error) {
		checkHeader(t, greq, nreq, cmdConnect, netlink.Request)
		checkTree(t, greq.Data,
			leaf(attrIndex, u32(5)),
			leaf(attrSizeBytes, u64(1<<30)),
			leaf(attrBlockSizeBytes, u64(512)),
			leaf(attrTimeout, u64(2)),
			leaf(attrServerFlags, u64(flagCanMultiConn|1)),
			leaf(attrClientFlags, u64(3)),
			nest(attrSockets,
				nest(attrSockItem, leaf(attrSockFD, u32(uint32(s1.Fd())))),
				nest(attrSockItem, leaf(attrSockFD, u32(uint32(s2.Fd())))),
			),
			leaf(attrDeadConnTimeout, u64(30)),
			leaf(attrBackendIdentifier, str("vol-1")),
		)
		return []genetlink.Message{{Header: genetlink.Header{Command: cmdConnect, Version: familyVersion}, Data: encodeIndex(5)}}, nil
	})
	index, err := c.Connect(ConnectOptions{
		Index:           new(uint32(5)),
		Sockets:         []*os.File{s1, s2},
		Size:            1 << 30,
		BlockSize:       512,
		Timeout:         1500 * time.Millisecond,
		DeadConnTimeout: 30 * time.Second,
		ServerFlags:     flagCanMultiConn | 1,
		ClientFlags:     DestroyOnDisconnect | DisconnectOnClose,
		BackendID:       "vol-1",
	})
	if err != nil {
		t.Fatal(err)
	}
	if index != 5 {
		t.Fatalf("index %d, want 5", index)
	}
}

func TestConnectMinimal(t *testing.T) {
	s, _ := pipeFiles(t)
	c := testClient(t, func(greq genetlink.Message, nreq netlink.Message) ([]genetlink.Message, error) {
		checkHeader(t, greq, nreq, cmdConnect, netlink.Request)
		checkTree(t, greq.Data,
			leaf(attrSizeBytes, u64(0)),
			leaf(attrBlockSizeBytes, u64(DefaultBlockSize)),
			nest(attrSockets, nest(attrSockItem, leaf(attrSockFD, u32(uint32(s.Fd()))))),
		)
		return []genetlink.Message{{Header: genetlink.Header{Command: cmdConnect}, Data: encodeIndex(3)}}, nil
	})
	index, err := c.Connect(ConnectOptions{Sockets: []*os.File{s}})
	if err != nil {
		t.Fatal(err)
	}
	if index != 3 {
		t.Fatalf("index %d, want the kernel's pick 3", index)
	}
}

func TestConnectReplyWithoutIndex(t *testing.T) {
	s, _ := pipeFiles(t)
	c := testClient(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		return []genetlink.Message{{Header: genetlink.Header{Command: cmdConnect}}}, nil
	})
	if _, err := c.Connect(ConnectOptions{Sockets: []*os.File{s}, Size: 1 << 20}); err == nil {
		t.Fatal("want an error for a reply without index")
	}
}

func TestConnectRejectedLocally(t *testing.T) {
	s1, s2 := pipeFiles(t)
	c := testClient(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		t.Error("request sent to the kernel")
		return nil, errors.New("unexpected")
	})
	for name, o := range map[string]ConnectOptions{
		"no socket":          {Size: 1 << 20},
		"nil socket":         {Size: 1 << 20, Sockets: []*os.File{nil}},
		"two without multi":  {Size: 1 << 20, Sockets: []*os.File{s1, s2}},
		"block size not 2^n": {Size: 1 << 20, Sockets: []*os.File{s1}, BlockSize: 1000},
		"block size 256":     {Size: 1 << 20, Sockets: []*os.File{s1}, BlockSize: 256},
		"negative timeout":   {Size: 1 << 20, Sockets: []*os.File{s1}, Timeout: -time.Second},
	} {
		if _, err := c.Connect(o); !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.EBADF) {
			t.Errorf("%s: err %v, want EINVAL or EBADF", name, err)
		}
	}
}

func TestDisconnect(t *testing.T) {
	c := testClient(t, func(greq genetlink.Message, nreq netlink.Message) ([]genetlink.Message, error) {
		checkHeader(t, greq, nreq, cmdDisconnect, netlink.Request|netlink.Acknowledge)
		checkTree(t, greq.Data, leaf(attrIndex, u32(7)))
		return ack(), nil
	})
	if err := c.Disconnect(7); err != nil {
		t.Fatal(err)
	}
}

func TestReconfigure(t *testing.T) {
	s, _ := pipeFiles(t)
	tests := []struct {
		name string
		o    ReconfigureOptions
		want []tattr
	}{
		{
			name: "nothing",
			want: []tattr{leaf(attrIndex, u32(2))},
		},
		{
			name: "socket without backend",
			o:    ReconfigureOptions{Sockets: []*os.File{s}},
			want: []tattr{
				leaf(attrIndex, u32(2)),
				nest(attrSockets, nest(attrSockItem, leaf(attrSockFD, u32(uint32(s.Fd()))))),
			},
		},
		{
			name: "everything",
			o: ReconfigureOptions{
				Sockets:         []*os.File{s},
				Size:            8 << 20,
				Timeout:         new(time.Duration(0)),
				DeadConnTimeout: new(90*time.Second + 1),
				ClientFlags:     new(DisconnectOnClose),
				BackendID:       "vol-9",
			},
			want: []tattr{
				leaf(attrIndex, u32(2)),
				leaf(attrSizeBytes, u64(8<<20)),
				leaf(attrTimeout, u64(0)),
				leaf(attrClientFlags, u64(uint64(DisconnectOnClose))),
				nest(attrSockets, nest(attrSockItem, leaf(attrSockFD, u32(uint32(s.Fd()))))),
				leaf(attrDeadConnTimeout, u64(91)),
				leaf(attrBackendIdentifier, str("vol-9")),
			},
		},
		{
			name: "backend only",
			o:    ReconfigureOptions{BackendID: "vol-9"},
			want: []tattr{leaf(attrIndex, u32(2)), leaf(attrBackendIdentifier, str("vol-9"))},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := testClient(t, func(greq genetlink.Message, nreq netlink.Message) ([]genetlink.Message, error) {
				checkHeader(t, greq, nreq, cmdReconfigure, netlink.Request|netlink.Acknowledge)
				checkTree(t, greq.Data, tt.want...)
				return ack(), nil
			})
			if err := c.Reconfigure(2, tt.o); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestStatus(t *testing.T) {
	devs := []DeviceStatus{{Index: 3, Connected: true}, {Index: 0}, {Index: 1, Connected: true}}
	c := testClient(t, func(greq genetlink.Message, nreq netlink.Message) ([]genetlink.Message, error) {
		checkHeader(t, greq, nreq, cmdStatus, netlink.Request)
		attrs := parseTree(t, greq.Data)
		reply := devs
		switch {
		case len(attrs) == 0:
		case len(attrs) == 1 && attrs[0].Type == attrIndex:
			// Like the kernel: the one device, or an empty list.
			reply = nil
			for _, d := range devs {
				if string(u32(d.Index)) == string(attrs[0].Data) {
					reply = []DeviceStatus{d}
				}
			}
		default:
			t.Errorf("status request attributes:\n%s", formatTree(attrs))
		}
		return []genetlink.Message{{Header: genetlink.Header{Command: cmdStatus, Version: familyVersion}, Data: encodeStatusReply(reply)}}, nil
	})

	st, err := c.Status(3)
	if err != nil {
		t.Fatal(err)
	}
	if st != (DeviceStatus{Index: 3, Connected: true}) {
		t.Fatalf("Status(3) = %+v", st)
	}
	if st, err := c.Status(0); err != nil || st != (DeviceStatus{Index: 0}) {
		t.Fatalf("Status(0) = %+v, %v", st, err)
	}
	if _, err := c.Status(42); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Status(42): %v, want ErrNotFound", err)
	}

	all, err := c.StatusAll()
	if err != nil {
		t.Fatal(err)
	}
	want := []DeviceStatus{{Index: 0}, {Index: 1, Connected: true}, {Index: 3, Connected: true}}
	if len(all) != len(want) {
		t.Fatalf("StatusAll = %+v, want %+v", all, want)
	}
	for i := range want {
		if all[i] != want[i] {
			t.Fatalf("StatusAll = %+v, want %+v", all, want)
		}
	}
}

func TestStatusIgnoresOtherDevices(t *testing.T) {
	// The kernel lists every device when the index reads as -1.
	c := testClient(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		return []genetlink.Message{{Data: encodeStatusReply([]DeviceStatus{{Index: 0, Connected: true}, {Index: 1}})}}, nil
	})
	if _, err := c.Status(0xffffffff); !errors.Is(err, ErrNotFound) {
		t.Fatalf("err %v, want ErrNotFound", err)
	}
}

// kernel fakes a kernel that fails one command with errno and answers
// STATUS from devs.
func kernel(t *testing.T, cmd uint8, errno unix.Errno, devs []DeviceStatus) genltest.Func {
	return func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
		switch greq.Header.Command {
		case cmd:
			return nil, genltest.Error(int(errno))
		case cmdStatus:
			attrs := parseTree(t, greq.Data)
			var reply []DeviceStatus
			for _, d := range devs {
				if len(attrs) == 1 && string(attrs[0].Data) == string(u32(d.Index)) {
					reply = append(reply, d)
				}
			}
			return []genetlink.Message{{Data: encodeStatusReply(reply)}}, nil
		}
		t.Errorf("unexpected command %d", greq.Header.Command)
		return nil, genltest.Error(int(unix.EOPNOTSUPP))
	}
}

func TestErrors(t *testing.T) {
	pipe, _ := pipeFiles(t)
	connected := []DeviceStatus{{Index: 4, Connected: true}}
	idle := []DeviceStatus{{Index: 4}}

	type call func(t *testing.T, c *Client) error
	connect := func(sockets ...func(*testing.T) *os.File) call {
		return func(t *testing.T, c *Client) error {
			o := ConnectOptions{Index: new(uint32(4)), Size: 1 << 20}
			for _, s := range sockets {
				o.Sockets = append(o.Sockets, s(t))
			}
			_, err := c.Connect(o)
			return err
		}
	}
	reconfigure := func(backend string, sockets ...func(*testing.T) *os.File) call {
		return func(t *testing.T, c *Client) error {
			o := ReconfigureOptions{BackendID: backend}
			for _, s := range sockets {
				o.Sockets = append(o.Sockets, s(t))
			}
			return c.Reconfigure(4, o)
		}
	}
	tcp := func(t *testing.T) *os.File { return socketFile(t, unix.IPPROTO_TCP) }
	mptcp := func(t *testing.T) *os.File { return socketFile(t, unix.IPPROTO_MPTCP) }
	plain := func(*testing.T) *os.File { return pipe }

	tests := []struct {
		name    string
		cmd     uint8
		errno   unix.Errno
		devs    []DeviceStatus
		backend string // content of block/nbd4/backend; "" means no file
		call    call
		want    error // sentinel; nil means none of them
	}{
		{"connect busy", cmdConnect, unix.EBUSY, nil, "", connect(plain), ErrBusy},
		{"connect racing create", cmdConnect, unix.EEXIST, nil, "", connect(plain), ErrBusy},
		{"connect mptcp refused", cmdConnect, unix.EINVAL, nil, "", connect(mptcp), ErrUnsupportedSocket},
		{"connect tcp einval", cmdConnect, unix.EINVAL, nil, "", connect(tcp), nil},
		{"connect eperm", cmdConnect, unix.EPERM, nil, "", connect(plain), nil},
		{"disconnect unknown", cmdDisconnect, unix.EINVAL, nil, "", func(t *testing.T, c *Client) error { return c.Disconnect(4) }, ErrNotFound},
		{"disconnect eperm", cmdDisconnect, unix.EPERM, nil, "", func(t *testing.T, c *Client) error { return c.Disconnect(4) }, nil},
		{"reconfigure unknown", cmdReconfigure, unix.EINVAL, nil, "", reconfigure("vol-a", plain), ErrNotFound},
		{"reconfigure not connected", cmdReconfigure, unix.EINVAL, idle, "", reconfigure("", plain), ErrNotFound},
		{"reconfigure wrong backend", cmdReconfigure, unix.EINVAL, connected, "vol-a", reconfigure("vol-b", mptcp), ErrBackendMismatch},
		{"reconfigure missing backend", cmdReconfigure, unix.EINVAL, connected, "vol-a", reconfigure("", plain), ErrBackendMismatch},
		{"reconfigure backend unreadable", cmdReconfigure, unix.EINVAL, connected, "", reconfigure("vol-a", plain), ErrBackendMismatch},
		{"reconfigure mptcp refused", cmdReconfigure, unix.EINVAL, connected, "vol-a", reconfigure("vol-a", mptcp), ErrUnsupportedSocket},
		{"reconfigure tcp einval", cmdReconfigure, unix.EINVAL, connected, "vol-a", reconfigure("vol-a", tcp), nil},
		{"reconfigure ebadf", cmdReconfigure, unix.EBADF, connected, "", reconfigure("", plain), nil},
	}
	sentinels := []error{ErrBusy, ErrNotFound, ErrBackendMismatch, ErrUnsupportedSocket, ErrFamilyNotFound}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := testClient(t, kernel(t, tt.cmd, tt.errno, tt.devs))
			if tt.backend != "" {
				dir := filepath.Join(c.sys.Root, "block", "nbd4")
				if err := os.MkdirAll(dir, 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(dir, "backend"), []byte(tt.backend+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			err := tt.call(t, c)
			if !errors.Is(err, tt.errno) {
				t.Fatalf("err %v does not wrap %v", err, tt.errno)
			}
			for _, s := range sentinels {
				if got := errors.Is(err, s); got != (s == tt.want) {
					t.Errorf("errors.Is(%v, %q) = %v", err, s, got)
				}
			}
			if tt.errno == unix.EPERM && !errors.Is(err, os.ErrPermission) {
				t.Errorf("%v is not os.ErrPermission", err)
			}
		})
	}
}

func TestFamilyNotFound(t *testing.T) {
	conn := genltest.Dial(func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		return nil, genltest.Error(int(unix.ENOENT))
	})
	defer conn.Close()
	_, err := newClient(conn)
	if !errors.Is(err, ErrFamilyNotFound) || !errors.Is(err, unix.ENOENT) {
		t.Fatalf("err %v, want ErrFamilyNotFound wrapping ENOENT", err)
	}

	root := t.TempDir()
	if err := familyNotFound(root, unix.ENOENT); !strings.Contains(err.Error(), "not loaded") {
		t.Errorf("no driver: %v", err)
	}
	if err := os.MkdirAll(filepath.Join(root, "module", "nbd"), 0o755); err != nil {
		t.Fatal(err)
	}
	err = familyNotFound(root, unix.ENOENT)
	if !strings.Contains(err.Error(), "network namespace") || !errors.Is(err, ErrFamilyNotFound) {
		t.Errorf("driver loaded: %v", err)
	}
}

// TestDialWithoutDriver runs against the real kernel: with no nbd driver the
// family lookup has to fail promptly with ErrFamilyNotFound.
func TestDialWithoutDriver(t *testing.T) {
	type result struct {
		c   *Client
		err error
	}
	done := make(chan result, 1)
	go func() {
		c, err := Dial()
		done <- result{c, err}
	}()
	select {
	case r := <-done:
		if r.err == nil {
			r.c.Close()
			if _, err := os.Stat("/sys/module/nbd"); err == nil {
				t.Skip("the nbd driver is loaded here")
			}
			t.Fatal("Dial succeeded without an nbd driver")
		}
		if !errors.Is(r.err, ErrFamilyNotFound) {
			t.Fatalf("Dial: %v, want ErrFamilyNotFound", r.err)
		}
		t.Logf("Dial: %v", r.err)
	case <-time.After(30 * time.Second):
		t.Fatal("Dial hangs")
	}
}

// mcastSocket is a netlink socket that delivers queued multicast messages.
type mcastSocket struct {
	msgs      chan []netlink.Message
	closed    chan struct{}
	closeOnce sync.Once

	mu     sync.Mutex
	groups []uint32
}

func newMcastSocket() *mcastSocket {
	return &mcastSocket{msgs: make(chan []netlink.Message, 8), closed: make(chan struct{})}
}

func (s *mcastSocket) Close() error {
	s.closeOnce.Do(func() { close(s.closed) })
	return nil
}
func (s *mcastSocket) Send(netlink.Message) error { return errors.New("send on a watch socket") }
func (s *mcastSocket) SendMessages([]netlink.Message) error {
	return errors.New("send on a watch socket")
}
func (s *mcastSocket) Receive() ([]netlink.Message, error) {
	select {
	case m := <-s.msgs:
		return m, nil
	case <-s.closed:
		return nil, os.ErrClosed
	}
}
func (s *mcastSocket) JoinGroup(g uint32) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.groups = append(s.groups, g)
	return nil
}
func (s *mcastSocket) LeaveGroup(uint32) error { return nil }

func (s *mcastSocket) push(t *testing.T, cmd uint8, data []byte) {
	t.Helper()
	b, err := (&genetlink.Message{Header: genetlink.Header{Command: cmd, Version: familyVersion}, Data: data}).MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	s.msgs <- []netlink.Message{{Header: netlink.Header{Type: netlink.HeaderType(testFamily.ID)}, Data: b}}
}

func TestWatchLinkDead(t *testing.T) {
	c := testClient(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		t.Error("request sent while watching")
		return nil, errors.New("unexpected")
	})
	sock := newMcastSocket()
	c.dialWatch = func() (*genetlink.Conn, error) {
		return genetlink.NewConn(netlink.NewConn(sock, 0)), nil
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := c.WatchLinkDead(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sock.mu.Lock()
	if len(sock.groups) != 1 || sock.groups[0] != 9 {
		t.Errorf("joined groups %v, want [9]", sock.groups)
	}
	sock.mu.Unlock()

	sock.push(t, cmdStatus, encodeStatusReply(nil)) // not an event
	sock.push(t, cmdLinkDead, nil)                  // malformed, skipped
	sock.push(t, cmdLinkDead, encodeIndex(2))
	sock.push(t, cmdLinkDead, encodeIndex(11))
	for _, want := range []uint32{2, 11} {
		select {
		case ev := <-ch:
			if ev.Index != want {
				t.Fatalf("event %+v, want index %d", ev, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("no event for index %d", want)
		}
	}

	cancel()
	select {
	case ev, ok := <-ch:
		if ok {
			t.Fatalf("event %+v after cancel", ev)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("channel not closed after cancel")
	}
	select {
	case <-sock.closed:
	case <-time.After(10 * time.Second):
		t.Fatal("watch socket not closed")
	}
}

func TestWatchLinkDeadWithoutGroup(t *testing.T) {
	f := testFamily
	f.Groups = nil
	c, err := newClient(genltest.Dial(genltest.ServeFamily(f, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		return nil, errors.New("unexpected")
	})))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.WatchLinkDead(context.Background()); err == nil {
		t.Fatal("want an error without multicast group")
	}
}
