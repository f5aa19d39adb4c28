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
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// Negotiate runs the client side of the fixed-newstyle handshake on rw
// and selects export with NBD_OPT_GO (falling back to NBD_OPT_EXPORT_NAME
// on servers without GO). On success rw is in the transmission phase with
// simple replies only, so it can be handed to the kernel's NBD client.
func Negotiate(rw io.ReadWriter, export string) (ExportInfo, error) {
	return NegotiateWith(rw, export, NegotiateOptions{})
}

// NegotiateOptions are the extras of a handshake.
type NegotiateOptions struct {
	// Session, when set, is announced with OptSession before GO (in the
	// same write); ExportInfo.Fenced then says whether the server took it.
	Session *Session
	// AskServers asks for the storage nodes that hold the export now
	// (InfoServers); ExportInfo.Servers has them when the server knows.
	AskServers bool
	// AskInfos asks for information types of ours that this package
	// does not know (ExportInfo.Infos has the answers).
	AskInfos []uint16
}

// NegotiateWith is Negotiate with options.
func NegotiateWith(rw io.ReadWriter, export string, no NegotiateOptions) (ExportInfo, error) {
	noZeroes, err := clientHello(rw)
	if err != nil {
		return ExportInfo{}, err
	}
	return negotiateGo(rw, export, no, noZeroes)
}

// startTLS asks the server to upgrade c to TLS (NBD_OPT_STARTTLS, right
// after the greeting) and runs the TLS handshake (tlsConfig of cfg).
func startTLS(c net.Conn, cfg *tls.Config) (*tls.Conn, error) {
	o := option{Code: OptStartTLS}
	if _, err := c.Write(o.encode()); err != nil {
		return nil, err
	}
	r, err := readOptReply(c)
	if err != nil {
		return nil, err
	}
	switch {
	case r.Option != OptStartTLS:
		return nil, fmt.Errorf("%w: reply to option %s while waiting for STARTTLS", ErrProtocol, OptName(r.Option))
	case r.Type&repErrBit != 0:
		return nil, &OptionError{Option: OptStartTLS, Reply: r.Type, Msg: printable(r.Data)}
	case r.Type != RepAck:
		return nil, fmt.Errorf("%w: STARTTLS answered with reply type %d", ErrProtocol, r.Type)
	}
	tc := tlsOver(c, cfg, false)
	if err := tc.Handshake(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrTLSHandshake, err)
	}
	bufferTLS(tc)
	return tc, nil
}

// negotiateGo selects export with GO (or EXPORT_NAME on old servers),
// after the greeting.
func negotiateGo(rw io.ReadWriter, export string, no NegotiateOptions, noZeroes bool) (ExportInfo, error) {
	q := InfoRequest{Name: export, Infos: []uint16{InfoBlockSize, InfoName, InfoDescription}}
	if no.AskServers {
		q.Infos = append(q.Infos, InfoServers)
	}
	q.Infos = append(q.Infos, no.AskInfos...)
	o := option{Code: OptGo, Data: q.encode()}
	msg := o.encode()
	if no.Session != nil {
		so := option{Code: OptSession, Data: no.Session.encode()}
		msg = append(so.encode(), msg...)
	}
	if _, err := rw.Write(msg); err != nil {
		return ExportInfo{}, err
	}
	info := ExportInfo{Name: export}
	if no.Session != nil {
		if err := readSessionReply(rw, &info); err != nil {
			return ExportInfo{}, err
		}
	}
	gotExport := false
	for {
		r, err := readOptReply(rw)
		if err != nil {
			return ExportInfo{}, err
		}
		if r.Option != OptGo {
			return ExportInfo{}, fmt.Errorf("%w: reply to option %s while waiting for GO", ErrProtocol, OptName(r.Option))
		}
		switch {
		case r.Type == RepInfo:
			if err := info.applyInfo(r.Data); err != nil {
				return ExportInfo{}, err
			}
			if len(r.Data) >= 2 && be.Uint16(r.Data) == InfoExport {
				gotExport = true
			}
		case r.Type == RepAck:
			if !gotExport {
				return ExportInfo{}, fmt.Errorf("%w: GO acknowledged without NBD_INFO_EXPORT", ErrProtocol)
			}
			return info, nil
		case r.Type == RepErrUnsup:
			return exportNameFallback(rw, export, noZeroes)
		case r.Type&repErrBit != 0:
			return ExportInfo{}, &OptionError{Option: OptGo, Reply: r.Type, Msg: printable(r.Data)}
		default:
			// Unknown non-error replies are skipped, as the protocol asks.
		}
	}
}

// clientHello reads the server greeting and sends the client flags.
func clientHello(rw io.ReadWriter) (noZeroes bool, err error) {
	var hello [18]byte
	if _, err := io.ReadFull(rw, hello[:]); err != nil {
		return false, fmt.Errorf("read greeting: %w", err)
	}
	if m := be.Uint64(hello[0:]); m != magicNBD {
		return false, fmt.Errorf("%w: greeting magic %#x", ErrBadMagic, m)
	}
	if m := be.Uint64(hello[8:]); m != magicIHaveOpt {
		return false, fmt.Errorf("%w: server speaks oldstyle (magic %#x)", ErrNotFixed, m)
	}
	sflags := be.Uint16(hello[16:])
	if sflags&flagFixedNewstyle == 0 {
		return false, ErrNotFixed
	}
	cflags := clientFlagFixedNewstyle
	if sflags&flagNoZeroes != 0 {
		cflags |= clientFlagNoZeroes
		noZeroes = true
	}
	var b [4]byte
	be.PutUint32(b[:], cflags)
	if _, err := rw.Write(b[:]); err != nil {
		return false, err
	}
	return noZeroes, nil
}

// readSessionReply reads the answer to OptSession: the incarnation and an
// ACK from a server that knows it, an error reply from one that does not.
func readSessionReply(rw io.Reader, info *ExportInfo) error {
	for {
		r, err := readOptReply(rw)
		if err != nil {
			return err
		}
		if r.Option != OptSession {
			return fmt.Errorf("%w: reply to option %s while waiting for the session option's", ErrProtocol, OptName(r.Option))
		}
		switch {
		case r.Type == RepSession:
			if len(r.Data) != len(info.Incarnation) {
				return fmt.Errorf("%w: session reply of %d bytes", ErrProtocol, len(r.Data))
			}
			copy(info.Incarnation[:], r.Data)
		case r.Type == RepAck:
			if info.Incarnation == (Incarnation{}) {
				return fmt.Errorf("%w: session option acknowledged without an incarnation", ErrProtocol)
			}
			info.Fenced = true
			return nil
		case r.Type&repErrBit != 0:
			// Not ours, or refused: carry on without fencing.
			return nil
		}
	}
}

func exportNameFallback(rw io.ReadWriter, export string, noZeroes bool) (ExportInfo, error) {
	o := option{Code: OptExportName, Data: []byte(export)}
	if _, err := rw.Write(o.encode()); err != nil {
		return ExportInfo{}, err
	}
	n := 10
	if !noZeroes {
		n += 124
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(rw, b); err != nil {
		// The server hangs up on an unknown export.
		return ExportInfo{}, fmt.Errorf("export %q: %w (%v)", export, ErrUnknownExport, err)
	}
	return ExportInfo{Name: export, Size: be.Uint64(b[0:]), Flags: be.Uint16(b[8:])}, nil
}

// ListExports asks the server for its export names, then ends the session
// with NBD_OPT_ABORT.
func ListExports(rw io.ReadWriter) ([]string, error) {
	if _, err := clientHello(rw); err != nil {
		return nil, err
	}
	o := option{Code: OptList}
	if _, err := rw.Write(o.encode()); err != nil {
		return nil, err
	}
	var names []string
	for {
		r, err := readOptReply(rw)
		if err != nil {
			return nil, err
		}
		if r.Option != OptList {
			return nil, fmt.Errorf("%w: reply to option %s while waiting for LIST", ErrProtocol, OptName(r.Option))
		}
		switch {
		case r.Type == RepServer:
			name, err := decodeServerReply(r.Data)
			if err != nil {
				return nil, err
			}
			names = append(names, name)
		case r.Type == RepAck:
			// A courtesy to the server: the list is complete either way.
			a := option{Code: OptAbort}
			_, _ = rw.Write(a.encode())
			return names, nil
		case r.Type&repErrBit != 0:
			return nil, &OptionError{Option: OptList, Reply: r.Type, Msg: printable(r.Data)}
		}
	}
}

func printable(b []byte) string {
	if len(b) > 256 {
		b = b[:256]
	}
	out := make([]rune, 0, len(b))
	for _, r := range string(b) {
		if r < 0x20 || r == 0x7f {
			r = '?'
		}
		out = append(out, r)
	}
	return string(out)
}

// NegotiateConn is Negotiate bounded by ctx (deadline or cancellation).
func NegotiateConn(ctx context.Context, c net.Conn, export string) (ExportInfo, error) {
	return NegotiateConnWith(ctx, c, export, NegotiateOptions{})
}

// NegotiateConnWith is NegotiateWith bounded by ctx.
func NegotiateConnWith(ctx context.Context, c net.Conn, export string, no NegotiateOptions) (ExportInfo, error) {
	var info ExportInfo
	err := bounded(ctx, c, func() (err error) {
		info, err = NegotiateWith(c, export, no)
		return err
	})
	return info, err
}

// NegotiateConnTLS is NegotiateConnWith over TLS: right after the
// greeting it upgrades c with NBD_OPT_STARTTLS and a TLS handshake
// under cfg, then selects export inside TLS. The returned connection
// (TLS over c) carries the transmission phase.
func NegotiateConnTLS(ctx context.Context, c net.Conn, export string, cfg *tls.Config, no NegotiateOptions) (net.Conn, ExportInfo, error) {
	var (
		tc   *tls.Conn
		info ExportInfo
	)
	err := bounded(ctx, c, func() error {
		noZeroes, err := clientHello(c)
		if err != nil {
			return err
		}
		if tc, err = startTLS(c, cfg); err != nil {
			return err
		}
		info, err = negotiateGo(tc, export, no, noZeroes)
		return err
	})
	if err != nil {
		return nil, ExportInfo{}, err
	}
	return tc, info, nil
}

// bounded runs f with c's deadline at ctx's (30 s without one), and
// interrupted when ctx ends.
func bounded(ctx context.Context, c net.Conn, f func() error) error {
	if d, ok := ctx.Deadline(); ok {
		c.SetDeadline(d)
	} else {
		c.SetDeadline(time.Now().Add(30 * time.Second))
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	err := f()
	if !stop() && err != nil {
		err = errors.Join(ctx.Err(), err)
	}
	c.SetDeadline(time.Time{})
	return err
}
