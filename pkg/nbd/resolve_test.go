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

package nbd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/syncbuf"
)

// grantTable is a Resolve hook: requested name -> grant.
type grantTable struct {
	mu     sync.Mutex
	grants map[string]Grant
}

func (g *grantTable) set(name string, gr *Grant) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if gr == nil {
		delete(g.grants, name)
		return
	}
	g.grants[name] = *gr
}

func (g *grantTable) resolve(_ ConnInfo, name string) (Grant, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if name == "unknown" {
		return Grant{}, fmt.Errorf("no such volume: %w", ErrUnknownExport)
	}
	gr, ok := g.grants[name]
	if !ok {
		return Grant{}, errors.New("not published")
	}
	return gr, nil
}

func newResolveServer(t *testing.T) (*Server, *MemBackend, *grantTable) {
	t.Helper()
	mem := NewMemBackend(1 << 20)
	s := newTestServer(t, &Export{Name: "vol", Backend: mem})
	g := &grantTable{grants: map[string]Grant{
		"vol/a":    {Export: "vol", Tag: "node-a"},
		"vol/ro":   {Export: "vol", Tag: "node-r", ReadOnly: true},
		"vol/gone": {Export: "no-such-export", Tag: "node-g"},
	}}
	s.Resolve = g.resolve
	return s, mem, g
}

func TestResolveServesGrantedNames(t *testing.T) {
	s, mem, _ := newResolveServer(t)
	cl := dialPipe(t, s, "vol/a", 1)
	if f := cl.Info().Flags; f&FlagReadOnly != 0 || f&FlagSendTrim == 0 {
		t.Fatalf("writable grant announced flags %#x", f)
	}
	want := randBytes(8192)
	if _, err := cl.WriteAt(want, 4096); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if _, err := cl.ReadAt(got, 4096); err != nil || string(got) != string(want) {
		t.Fatalf("read back: %v (equal %v)", err, string(got) == string(want))
	}
	if string(mem.data[4096:4096+8192]) != string(want) {
		t.Fatal("the write did not reach the export's backend")
	}
}

func TestResolveRefusals(t *testing.T) {
	s, _, _ := newResolveServer(t)
	cases := []struct {
		name string
		want error
	}{
		{"vol", ErrAccessDenied},       // the plain export name is not granted
		{"vol/other", ErrAccessDenied}, // an unknown token
		{"unknown", ErrUnknownExport},  // Resolve says unknown
		{"vol/gone", ErrUnknownExport}, // granted, but the export is not served
		{"", ErrAccessDenied},          // no default export
	}
	for _, tc := range cases {
		if _, err := NegotiateConn(context.Background(), pipeConn(t, s), tc.name); !errors.Is(err, tc.want) {
			t.Errorf("open %q: %v, want %v", tc.name, err, tc.want)
		}
	}
	// EXPORT_NAME can only hang up on a refused name.
	c := pipeConn(t, s)
	noZeroes, err := clientHello(c)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := exportNameFallback(c, "vol", noZeroes); err == nil {
		t.Fatal("EXPORT_NAME of an ungranted name succeeded")
	}
	// Listing shows only names Resolve grants; none of the export names is.
	names, err := ListExports(pipeConn(t, s))
	if err != nil || len(names) != 0 {
		t.Fatalf("list = %v, %v", names, err)
	}
}

// TestResolveRefusalsLogNoName: the names clients ask for may carry a
// credential; a refusal logs Resolve's reason, never the name.
func TestResolveRefusalsLogNoName(t *testing.T) {
	s, _, _ := newResolveServer(t)
	var buf syncbuf.Buffer
	s.Logger = slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	const secret = "0123456789abcdef0123456789abcdef"
	for _, name := range []string{"vol/" + secret, "unknown"} {
		if _, err := NegotiateConn(context.Background(), pipeConn(t, s), name); err == nil {
			t.Fatalf("open %q succeeded", name)
		}
	}
	c := pipeConn(t, s)
	noZeroes, err := clientHello(c)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := exportNameFallback(c, "vol/"+secret, noZeroes); err == nil {
		t.Fatal("EXPORT_NAME of an ungranted name succeeded")
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(buf.String(), "not published") && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if log := buf.String(); !strings.Contains(log, "not published") || strings.Contains(log, secret) {
		t.Fatalf("the server's log holds the name asked for, or not the reason:\n%s", log)
	}
}

func TestResolveReadOnlyGrant(t *testing.T) {
	s, mem, _ := newResolveServer(t)
	copy(mem.data, "hello")
	cl := dialPipe(t, s, "vol/ro", 1)
	f := cl.Info().Flags
	if f&FlagReadOnly == 0 || f&(FlagSendTrim|FlagSendWriteZeroes) != 0 {
		t.Fatalf("read-only grant announced flags %#x", f)
	}
	var nerr *Error
	if _, err := cl.WriteAt(make([]byte, 4096), 0); !errors.As(err, &nerr) || nerr.Errno != EPERM {
		t.Fatalf("write: %v, want EPERM", err)
	}
	if err := cl.Trim(0, 4096); !errors.As(err, &nerr) || nerr.Errno != EPERM {
		t.Fatalf("trim: %v, want EPERM", err)
	}
	if err := cl.WriteZeroes(0, 4096, false); !errors.As(err, &nerr) || nerr.Errno != EPERM {
		t.Fatalf("write zeroes: %v, want EPERM", err)
	}
	got := make([]byte, 5)
	if _, err := cl.ReadAt(got, 0); err != nil || string(got) != "hello" {
		t.Fatalf("read: %q, %v", got, err)
	}
	if string(mem.data[:5]) != "hello" {
		t.Fatal("a refused request changed the backend")
	}

	// EXPORT_NAME announces the flag too.
	c := pipeConn(t, s)
	noZeroes, err := clientHello(c)
	if err != nil {
		t.Fatal(err)
	}
	info, err := exportNameFallback(c, "vol/ro", noZeroes)
	if err != nil || info.Flags&FlagReadOnly == 0 {
		t.Fatalf("EXPORT_NAME: %+v, %v", info, err)
	}

	// The same export stays writable for a writable grant.
	rw := dialPipe(t, s, "vol/a", 1)
	if _, err := rw.WriteAt(make([]byte, 4096), 0); err != nil {
		t.Fatalf("writable connection next to a read-only one: %v", err)
	}
}

func TestCloseConnsByTag(t *testing.T) {
	s, _, g := newResolveServer(t)
	a := dialPipe(t, s, "vol/a", 2)
	r := dialPipe(t, s, "vol/ro", 1)
	buf := make([]byte, 4096)
	for _, cl := range []*Client{a, r} {
		if _, err := cl.ReadAt(buf, 0); err != nil {
			t.Fatal(err)
		}
	}
	// Revoke node-a: Resolve refuses it from now on, then its connections go.
	g.set("vol/a", nil)
	var requested []string
	n, err := s.CloseConns(context.Background(), "vol", func(c ConnInfo) bool {
		if c.Tag == "node-a" {
			requested = append(requested, c.Requested)
			return true
		}
		return false
	})
	if err != nil || n != 2 {
		t.Fatalf("CloseConns = %d, %v; want 2 connections", n, err)
	}
	for _, q := range requested {
		if q != "vol/a" {
			t.Errorf("ConnInfo.Requested = %q, want vol/a", q)
		}
	}
	for i := 0; i < 2; i++ { // both connections of the client
		if _, err := a.ReadAt(buf, 0); err == nil {
			t.Fatal("I/O on a closed connection succeeded")
		}
	}
	if _, err := r.ReadAt(buf, 0); err != nil {
		t.Fatalf("another tag's connection was closed: %v", err)
	}
	if _, err := NegotiateConn(context.Background(), pipeConn(t, s), "vol/a"); !errors.Is(err, ErrAccessDenied) {
		t.Fatalf("reopen after revocation: %v", err)
	}
}

// TestResolveRevokedDuringNegotiation: a grant withdrawn between the
// answer to GO and the connection joining its export does not survive.
func TestResolveRevokedDuringNegotiation(t *testing.T) {
	s := newTestServer(t, &Export{Name: "vol", Backend: NewMemBackend(1 << 20)})
	var calls atomic.Int32
	s.Resolve = func(_ ConnInfo, name string) (Grant, error) {
		if calls.Add(1) > 1 {
			return Grant{}, errors.New("revoked")
		}
		return Grant{Export: "vol", Tag: "n"}, nil
	}
	c := pipeConn(t, s)
	info, err := NegotiateConn(context.Background(), c, "vol/x")
	if err != nil {
		t.Fatal(err)
	}
	cl := NewClient(info, []net.Conn{c}, quietLogger())
	defer cl.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := cl.ReadAt(make([]byte, 4096), 0); err == nil {
		t.Fatal("I/O succeeded on a connection whose grant was revoked")
	}
	if calls.Load() < 2 {
		t.Fatalf("Resolve called %d times, want a second check", calls.Load())
	}
}
