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
	"bufio"
	"bytes"
	"io"
	"net"
	"testing"
	"time"
)

// fakeConn feeds fixed bytes to whoever reads and swallows writes.
type fakeConn struct {
	r io.Reader
}

func (f *fakeConn) Read(p []byte) (int, error)       { return f.r.Read(p) }
func (f *fakeConn) Write(p []byte) (int, error)      { return len(p), nil }
func (f *fakeConn) Close() error                     { return nil }
func (f *fakeConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (f *fakeConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (f *fakeConn) SetDeadline(time.Time) error      { return nil }
func (f *fakeConn) SetReadDeadline(time.Time) error  { return nil }
func (f *fakeConn) SetWriteDeadline(time.Time) error { return nil }

// guardBackend fails the test on any access outside the export.
type guardBackend struct {
	*MemBackend
	t testing.TB
}

func (g *guardBackend) check(op string, off, n int64) {
	if off < 0 || n < 0 || off+n > g.Size() {
		g.t.Errorf("%s at %d+%d outside the %d-byte export", op, off, n, g.Size())
	}
}

func (g *guardBackend) ReadAt(p []byte, off int64) (int, error) {
	g.check("read", off, int64(len(p)))
	return g.MemBackend.ReadAt(p, off)
}

func (g *guardBackend) WriteAt(p []byte, off int64) (int, error) {
	g.check("write", off, int64(len(p)))
	return g.MemBackend.WriteAt(p, off)
}

func (g *guardBackend) Trim(off, n int64) error {
	g.check("trim", off, n)
	return g.MemBackend.Trim(off, n)
}

func (g *guardBackend) Zero(off, n int64, noHole bool) error {
	g.check("zero", off, n)
	return g.MemBackend.Zero(off, n, noHole)
}

func clientOpening(export string) []byte {
	var b bytes.Buffer
	b.Write([]byte{0, 0, 0, 3})
	q := InfoRequest{Name: export, Infos: []uint16{InfoBlockSize}}
	o := option{Code: OptGo, Data: q.encode()}
	b.Write(o.encode())
	return b.Bytes()
}

func reqBytes(rs ...Request) []byte {
	var out []byte
	for _, r := range rs {
		var b [requestHeaderSize]byte
		r.Encode(b[:])
		out = append(out, b[:]...)
		if r.Type == CmdWrite && r.Length < 1<<16 {
			out = append(out, make([]byte, r.Length)...)
		}
	}
	return out
}

// FuzzServerNegotiate feeds arbitrary client bytes to a whole server
// connection: negotiation and, if it gets that far, transmission.
func FuzzServerNegotiate(f *testing.F) {
	f.Add(clientOpening("d"))
	f.Add(append(clientOpening(""), reqBytes(Request{Type: CmdRead, Length: 512})...))
	list := option{Code: OptList}
	f.Add(append([]byte{0, 0, 0, 1}, list.encode()...))
	en := option{Code: OptExportName, Data: []byte("d")}
	f.Add(append([]byte{0, 0, 0, 1}, en.encode()...))
	sess := option{Code: OptSession, Data: Session{ID: SessionID{1}, Lane: 2, Generation: 3}.encode()}
	f.Add(append(append([]byte{0, 0, 0, 1}, sess.encode()...), clientOpening("d")[4:]...))
	f.Fuzz(func(t *testing.T, data []byte) {
		s := &Server{Logger: quietLogger(), DefaultExport: "d"}
		if err := s.AddExport(&Export{Name: "d", Backend: &guardBackend{MemBackend: NewMemBackend(65536), t: t}}); err != nil {
			t.Fatal(err)
		}
		s.ServeConn(&fakeConn{r: bytes.NewReader(data)})
	})
}

// FuzzServerRequests feeds arbitrary bytes to the transmission phase.
func FuzzServerRequests(f *testing.F) {
	f.Add(reqBytes(Request{Type: CmdWrite, Offset: 4096, Length: 8}, Request{Type: CmdRead, Length: 4096}))
	f.Add(reqBytes(Request{Type: CmdTrim, Offset: 65535, Length: 2}, Request{Type: CmdFlush, Flags: CmdFlagFUA}))
	f.Add(reqBytes(Request{Type: CmdWriteZeroes, Flags: CmdFlagNoHole, Offset: 0, Length: 65536}))
	f.Add(reqBytes(Request{Type: CmdRead, Offset: ^uint64(0), Length: ^uint32(0)}))
	f.Add(reqBytes(Request{Type: CmdDisc}))
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, ro := range []bool{false, true} {
			e := &Export{Name: "d", ReadOnly: ro, Backend: &guardBackend{MemBackend: NewMemBackend(65536), t: t}}
			sc := &serverConn{
				srv:      &Server{Logger: quietLogger()},
				conn:     &fakeConn{r: bytes.NewReader(nil)},
				export:   e,
				log:      quietLogger(),
				hsReader: bufio.NewReader(bytes.NewReader(data)),
			}
			sc.transmit()
		}
	})
}

// FuzzClientNegotiate feeds arbitrary server bytes to the client handshake.
func FuzzClientNegotiate(f *testing.F) {
	var good bytes.Buffer
	good.Write([]byte("NBDMAGICIHAVEOPT\x00\x03"))
	for _, r := range []optReply{
		{Option: OptGo, Type: RepInfo, Data: encodeInfoExport(1<<20, FlagHasFlags)},
		{Option: OptGo, Type: RepInfo, Data: encodeInfoBlockSize(1, 4096, 1<<25)},
		{Option: OptGo, Type: RepAck},
	} {
		good.Write(r.encode())
	}
	f.Add(good.Bytes())
	unsup := optReply{Option: OptGo, Type: RepErrUnsup}
	f.Add(append(append([]byte("NBDMAGICIHAVEOPT\x00\x01"), unsup.encode()...), make([]byte, 134)...))
	f.Add([]byte("NBDMAGIC\x00\x00\x42\x02\x81\x86\x12\x53"))
	var withSession bytes.Buffer
	withSession.Write([]byte("NBDMAGICIHAVEOPT\x00\x03"))
	for _, r := range []optReply{
		{Option: OptSession, Type: RepSession, Data: make([]byte, 16)},
		{Option: OptSession, Type: RepAck},
	} {
		withSession.Write(r.encode())
	}
	withSession.Write(good.Bytes()[18:])
	f.Add(withSession.Bytes())
	f.Fuzz(func(t *testing.T, data []byte) {
		rw := struct {
			io.Reader
			io.Writer
		}{bytes.NewReader(data), io.Discard}
		// Errors are the rule here: what the fuzzer looks for is a crash.
		_, _ = Negotiate(rw, "d")
		_, _ = NegotiateWith(struct {
			io.Reader
			io.Writer
		}{bytes.NewReader(data), io.Discard}, "d", NegotiateOptions{Session: &Session{ID: SessionID{9}, Generation: 1}})
		_, _ = ListExports(struct {
			io.Reader
			io.Writer
		}{bytes.NewReader(data), io.Discard})
	})
}

// FuzzClientReplies feeds arbitrary reply streams to a client connection
// with requests pending.
func FuzzClientReplies(f *testing.F) {
	rep := func(errno uint32, h uint64, payload int) []byte {
		b := make([]byte, replyHeaderSize+payload)
		(&Reply{Errno: errno, Handle: h}).Encode(b)
		return b
	}
	f.Add(append(rep(0, 1, 512), rep(0, 2, 0)...))
	f.Add(append(rep(EIO, 1, 0), rep(0, 99, 0)...))
	f.Add(rep(0, 3, 100))
	f.Fuzz(func(t *testing.T, data []byte) {
		c := &clientConn{
			conn:    &fakeConn{r: bytes.NewReader(nil)},
			r:       bufio.NewReader(bytes.NewReader(data)),
			pending: make(map[uint64]*call),
		}
		calls := []*call{
			{cmd: CmdRead, dst: make([]byte, 512), done: make(chan error, 1)},
			{cmd: CmdWrite, done: make(chan error, 1)},
			{cmd: CmdRead, dst: make([]byte, 4096), done: make(chan error, 1)},
		}
		for i, cl := range calls {
			c.pending[uint64(i+1)] = cl
		}
		c.readLoop()
		for i, cl := range calls {
			select {
			case <-cl.done:
			default:
				t.Fatalf("call %d never completed", i+1)
			}
		}
	})
}

// FuzzServerStartTLS feeds arbitrary client bytes to a server that offers
// STARTTLS (required when the first byte is odd): option haggling before
// and around the upgrade, and garbage where the TLS handshake belongs.
func FuzzServerStartTLS(f *testing.F) {
	pki := newTestPKI(f)
	flags := []byte{0, 0, 0, 1}
	starttls := option{Code: OptStartTLS}
	withData := option{Code: OptStartTLS, Data: []byte("x")}
	en := option{Code: OptExportName, Data: []byte("d")}
	list := option{Code: OptList}
	f.Add(append([]byte{1}, append(flags, starttls.encode()...)...))
	f.Add(append([]byte{1}, append(append(flags, starttls.encode()...), clientOpening("d")[4:]...)...))
	f.Add(append([]byte{0}, append(append(flags, withData.encode()...), starttls.encode()...)...))
	f.Add(append([]byte{1}, append(append(flags, list.encode()...), en.encode()...)...))
	f.Add(append([]byte{0}, clientOpening("d")...))
	f.Add(append([]byte{1}, append(append(flags, starttls.encode()...), 0x16, 3, 1, 0, 4, 1, 0, 0, 0)...))
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		s := &Server{Logger: quietLogger(), DefaultExport: "d", TLSConfig: pki.server, TLSRequired: data[0]&1 == 1}
		if err := s.AddExport(&Export{Name: "d", RequireTLS: data[0]&2 == 2, Backend: &guardBackend{MemBackend: NewMemBackend(65536), t: t}}); err != nil {
			t.Fatal(err)
		}
		s.ServeConn(&fakeConn{r: bytes.NewReader(data[1:])})
	})
}

// FuzzClientStartTLS feeds arbitrary server bytes to the client's
// greeting and STARTTLS.
func FuzzClientStartTLS(f *testing.F) {
	pki := newTestPKI(f)
	ack := optReply{Option: OptStartTLS, Type: RepAck}
	f.Add(append([]byte("NBDMAGICIHAVEOPT\x00\x03"), ack.encode()...))
	tlsReqd := optReply{Option: OptStartTLS, Type: RepErrTLSReqd, Data: []byte("no")}
	f.Add(append([]byte("NBDMAGICIHAVEOPT\x00\x03"), tlsReqd.encode()...))
	other := optReply{Option: OptGo, Type: RepAck}
	f.Add(append([]byte("NBDMAGICIHAVEOPT\x00\x03"), other.encode()...))
	f.Fuzz(func(t *testing.T, data []byte) {
		c := &fakeConn{r: bytes.NewReader(data)}
		if _, err := clientHello(c); err != nil {
			return
		}
		// Errors are the rule here: what the fuzzer looks for is a crash.
		_, _ = startTLS(c, pki.client)
	})
}
