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
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"
)

var (
	errEOF           = io.EOF
	errUnexpectedEOF = io.ErrUnexpectedEOF
)

// maxOptions bounds the options one client may send before choosing an
// export, so a peer cannot keep a connection in negotiation forever.
const maxOptions = 256

// Block size constraints announced with NBD_INFO_BLOCK_SIZE.
const (
	minBlock  = 1
	prefBlock = 4096
)

// negotiate runs the fixed-newstyle handshake on sc and returns the export
// the client chose. It never negotiates structured replies or extended
// headers: the kernel client speaks only simple replies.
func (s *Server) negotiate(sc *serverConn) (*Export, error) {
	lim := s.Limits.resolve()
	c := sc.conn
	if lim.hsTimeout > 0 {
		c.SetDeadline(time.Now().Add(lim.hsTimeout))
		defer c.SetDeadline(time.Time{})
	}

	var hello [18]byte
	be.PutUint64(hello[0:], magicNBD)
	be.PutUint64(hello[8:], magicIHaveOpt)
	be.PutUint16(hello[16:], flagFixedNewstyle|flagNoZeroes)
	if _, err := c.Write(hello[:]); err != nil {
		return nil, err
	}
	var cf [4]byte
	if _, err := io.ReadFull(c, cf[:]); err != nil {
		return nil, err
	}
	cflags := binary.BigEndian.Uint32(cf[:])
	if cflags&clientFlagFixedNewstyle == 0 {
		return nil, ErrNotFixed
	}
	if cflags&^(clientFlagFixedNewstyle|clientFlagNoZeroes) != 0 {
		return nil, fmt.Errorf("%w: unknown client flags %#x", ErrProtocol, cflags)
	}
	noZeroes := cflags&clientFlagNoZeroes != 0

	br := bufio.NewReaderSize(c, 4096)
	// A client may pipeline its first requests behind GO: keep what was
	// read ahead for the transmission phase.
	sc.hsReader = br
	bw := bufio.NewWriterSize(c, 4096)
	tlsRequired := s.TLSRequired && s.TLSConfig != nil
	// needsTLS says a connection without TLS may not have e.
	reply := func(opt, typ uint32, data []byte) error {
		r := optReply{Option: opt, Type: typ, Data: data}
		_, err := bw.Write(r.encode())
		return err
	}
	replyErr := func(opt, typ uint32, msg string) error {
		if err := reply(opt, typ, []byte(msg)); err != nil {
			return err
		}
		return bw.Flush()
	}

	needsTLS := func(e *Export, g Grant) bool {
		return sc.info.TLS == nil && (tlsRequired || e.RequireTLS || g.RequireTLS)
	}

	for n := 0; ; n++ {
		if n >= maxOptions {
			return nil, fmt.Errorf("%w: more than %d options", ErrProtocol, maxOptions)
		}
		o, err := readOption(br)
		if err != nil {
			return nil, err
		}
		if tlsRequired && sc.info.TLS == nil && o.Code != OptStartTLS && o.Code != OptAbort {
			if o.Code == OptExportName {
				return nil, fmt.Errorf("%w: EXPORT_NAME before STARTTLS", ErrTLSRequired)
			}
			if err := replyErr(o.Code, RepErrTLSReqd, "TLS is required: send STARTTLS first"); err != nil {
				return nil, err
			}
			continue
		}
		switch o.Code {
		case OptStartTLS:
			switch {
			case s.TLSConfig == nil:
				err = replyErr(o.Code, RepErrUnsup, "TLS is not offered")
			case sc.info.TLS != nil:
				err = replyErr(o.Code, RepErrInvalid, "TLS is already on")
			case len(o.Data) != 0:
				err = replyErr(o.Code, RepErrInvalid, "STARTTLS takes no data")
			default:
				if err := replyErr(o.Code, RepAck, ""); err != nil {
					return nil, err
				}
				if br.Buffered() > 0 {
					return nil, fmt.Errorf("%w: data sent behind STARTTLS before the TLS handshake", ErrProtocol)
				}
				tc := tlsOver(c, s.TLSConfig, true)
				if err := tc.Handshake(); err != nil {
					return nil, fmt.Errorf("%w: %w", ErrTLSHandshake, err)
				}
				st := tc.ConnectionState()
				sc.conn, sc.info.TLS = tc, &st
				c = tc
				br = bufio.NewReaderSize(tc, 4096)
				sc.hsReader = br
				bw = bufio.NewWriterSize(tc, 4096)
				continue
			}
			if err != nil {
				return nil, err
			}

		case OptExportName:
			if len(o.Data) > maxNameLen {
				return nil, fmt.Errorf("%w: export name of %d bytes", ErrProtocol, len(o.Data))
			}
			e, g, _, err := s.lookup(sc.info, string(o.Data))
			if err != nil {
				// EXPORT_NAME has no error reply: the only answer is to hang up.
				return nil, err
			}
			if needsTLS(e, g) {
				return nil, fmt.Errorf("%w: EXPORT_NAME of %q without TLS", ErrTLSRequired, e.Name)
			}
			if !sc.reserve(e, lim.perExport) {
				return nil, errPerExport
			}
			sc.chose(e, g, string(o.Data))
			b := make([]byte, 10, 10+124)
			be.PutUint64(b[0:], uint64(e.Backend.Size()))
			be.PutUint16(b[8:], e.flags(sc.readOnly))
			if !noZeroes {
				b = b[:10+124]
			}
			if _, err := bw.Write(b); err != nil {
				return nil, err
			}
			return e, bw.Flush()

		case OptAbort:
			// Best effort: the client may already have gone.
			_ = reply(o.Code, RepAck, nil)
			bw.Flush()
			return nil, ErrAborted

		case OptList:
			if len(o.Data) != 0 {
				if err := replyErr(o.Code, RepErrInvalid, "LIST takes no data"); err != nil {
					return nil, err
				}
				continue
			}
			if s.DisableList {
				if err := replyErr(o.Code, RepErrPolicy, "listing exports is disabled"); err != nil {
					return nil, err
				}
				continue
			}
			for _, name := range s.Exports() {
				if _, _, _, err := s.lookup(sc.info, name); err != nil {
					continue
				}
				if err := reply(o.Code, RepServer, encodeServerReply(name)); err != nil {
					return nil, err
				}
			}
			if err := replyErr(o.Code, RepAck, ""); err != nil {
				return nil, err
			}

		case OptInfo, OptGo:
			q, err := decodeInfoRequest(o.Data)
			if err != nil {
				if err := replyErr(o.Code, RepErrInvalid, err.Error()); err != nil {
					return nil, err
				}
				continue
			}
			e, g, rep, err := s.lookup(sc.info, q.Name)
			if err != nil {
				msg := "unknown export"
				switch {
				case rep == RepErrPolicy && errors.Is(err, ErrSuperseded):
					msg = SupersededMessage + ": a newer grant replaced this one"
				case rep == RepErrPolicy:
					msg = "access denied"
				}
				if err := replyErr(o.Code, rep, msg); err != nil {
					return nil, err
				}
				continue
			}
			if needsTLS(e, g) {
				if err := replyErr(o.Code, RepErrTLSReqd, "this export requires TLS: send STARTTLS first"); err != nil {
					return nil, err
				}
				continue
			}
			if o.Code == OptGo && !sc.reserve(e, lim.perExport) {
				// Server policy forbids more connections to this export.
				// The client could go on haggling, but would only find
				// the export full again: answer, then hang up.
				_ = replyErr(o.Code, RepErrPolicy, "too many connections to this export")
				return nil, errPerExport
			}
			if err := reply(o.Code, RepInfo, encodeInfoExport(uint64(e.Backend.Size()), e.flags(g.ReadOnly))); err != nil {
				return nil, err
			}
			for _, t := range q.Infos {
				var data []byte
				switch t {
				case InfoName:
					data = encodeInfoString(InfoName, e.Name)
				case InfoDescription:
					if e.Description != "" {
						data = encodeInfoString(InfoDescription, e.Description)
					}
				case InfoBlockSize:
					data = encodeInfoBlockSize(minBlock, prefBlock, MaxRequestSize)
				case InfoExport:
					// Sent first, whatever the list.
				case InfoServers:
					if len(g.Servers) > 0 {
						var eerr error
						if data, eerr = encodeInfoServers(g.Servers); eerr != nil {
							s.log().Warn("the export's servers are not sent", "export", g.Export, "error", eerr)
						}
					}
				default:
					if g.Info != nil {
						if b := g.Info(t); b != nil {
							data = append(be.AppendUint16(nil, t), b...)
						}
					}
				}
				if data != nil {
					if err := reply(o.Code, RepInfo, data); err != nil {
						return nil, err
					}
				}
			}
			if err := replyErr(o.Code, RepAck, ""); err != nil {
				return nil, err
			}
			if o.Code == OptGo {
				sc.chose(e, g, q.Name)
				return e, nil
			}

		case OptSession:
			sess, err := decodeSession(o.Data)
			if err != nil {
				if err := replyErr(o.Code, RepErrInvalid, err.Error()); err != nil {
					return nil, err
				}
				continue
			}
			sc.session = &sess
			inc := s.incarnation()
			if err := reply(o.Code, RepSession, inc[:]); err != nil {
				return nil, err
			}
			if err := replyErr(o.Code, RepAck, ""); err != nil {
				return nil, err
			}

		default:
			// STRUCTURED_REPLY, EXTENDED_HEADERS, meta contexts and anything
			// unknown: the simple reply format is all we speak.
			if err := replyErr(o.Code, RepErrUnsup, "unsupported option "+OptName(o.Code)); err != nil {
				return nil, err
			}
		}
	}
}

// reserve takes a connection slot of e for sc, which keeps it until it is
// closed. sc.reserved is set under the server's lock, for ExportConns.
func (sc *serverConn) reserve(e *Export, max int) bool {
	if !e.reserve(max) {
		return false
	}
	sc.srv.mu.Lock()
	sc.reserved = e
	sc.srv.mu.Unlock()
	return true
}

// chose records the export a connection negotiated: the name asked for,
// the grant's tag and whether the connection is read-only.
func (sc *serverConn) chose(e *Export, g Grant, requested string) {
	sc.readOnly = e.ReadOnly || g.ReadOnly
	sc.info.Requested = requested
	sc.info.Tag = g.Tag
}
