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
	"encoding/binary"
	"fmt"
	"io"
	"slices"
)

var be = binary.BigEndian

// Request is a transmission-phase request header.
type Request struct {
	Flags  uint16
	Type   uint16
	Handle uint64
	Offset uint64
	Length uint32
}

// Encode writes the 28-byte header into b.
func (r *Request) Encode(b []byte) {
	_ = b[requestHeaderSize-1]
	be.PutUint32(b[0:], magicRequest)
	be.PutUint16(b[4:], r.Flags)
	be.PutUint16(b[6:], r.Type)
	be.PutUint64(b[8:], r.Handle)
	be.PutUint64(b[16:], r.Offset)
	be.PutUint32(b[24:], r.Length)
}

// DecodeRequest parses a 28-byte request header.
func DecodeRequest(b []byte) (Request, error) {
	if len(b) < requestHeaderSize {
		return Request{}, fmt.Errorf("%w: short request header (%d bytes)", ErrProtocol, len(b))
	}
	if m := be.Uint32(b[0:]); m != magicRequest {
		return Request{}, fmt.Errorf("%w: request magic %#x", ErrBadMagic, m)
	}
	return Request{
		Flags:  be.Uint16(b[4:]),
		Type:   be.Uint16(b[6:]),
		Handle: be.Uint64(b[8:]),
		Offset: be.Uint64(b[16:]),
		Length: be.Uint32(b[24:]),
	}, nil
}

// Reply is a simple reply header.
type Reply struct {
	Errno  uint32
	Handle uint64
}

// Encode writes the 16-byte header into b.
func (r *Reply) Encode(b []byte) {
	_ = b[replyHeaderSize-1]
	be.PutUint32(b[0:], magicSimpleReply)
	be.PutUint32(b[4:], r.Errno)
	be.PutUint64(b[8:], r.Handle)
}

// DecodeReply parses a 16-byte simple reply header.
func DecodeReply(b []byte) (Reply, error) {
	if len(b) < replyHeaderSize {
		return Reply{}, fmt.Errorf("%w: short reply header (%d bytes)", ErrProtocol, len(b))
	}
	if m := be.Uint32(b[0:]); m != magicSimpleReply {
		return Reply{}, fmt.Errorf("%w: reply magic %#x", ErrBadMagic, m)
	}
	return Reply{Errno: be.Uint32(b[4:]), Handle: be.Uint64(b[8:])}, nil
}

// option is one client option with its payload.
type option struct {
	Code uint32
	Data []byte
}

func (o *option) encode() []byte {
	b := make([]byte, optHeaderSize+len(o.Data))
	be.PutUint64(b[0:], magicIHaveOpt)
	be.PutUint32(b[8:], o.Code)
	be.PutUint32(b[12:], uint32(len(o.Data)))
	copy(b[optHeaderSize:], o.Data)
	return b
}

// decodeOptionHeader parses the 16-byte option header and returns the code
// and the announced payload length.
func decodeOptionHeader(b []byte) (code, length uint32, err error) {
	if len(b) < optHeaderSize {
		return 0, 0, fmt.Errorf("%w: short option header", ErrProtocol)
	}
	if m := be.Uint64(b[0:]); m != magicIHaveOpt {
		return 0, 0, fmt.Errorf("%w: option magic %#x", ErrBadMagic, m)
	}
	return be.Uint32(b[8:]), be.Uint32(b[12:]), nil
}

// readOption reads one option from r, refusing oversized payloads.
func readOption(r io.Reader) (option, error) {
	var h [optHeaderSize]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return option{}, err
	}
	code, n, err := decodeOptionHeader(h[:])
	if err != nil {
		return option{}, err
	}
	if n > maxOptionLen {
		return option{}, fmt.Errorf("%w: option %s payload of %d bytes", ErrTooBig, OptName(code), n)
	}
	data := make([]byte, n)
	if _, err := io.ReadFull(r, data); err != nil {
		return option{}, err
	}
	return option{Code: code, Data: data}, nil
}

// optReply is one server reply to an option.
type optReply struct {
	Option uint32
	Type   uint32
	Data   []byte
}

func (o *optReply) encode() []byte {
	b := make([]byte, optReplyHeaderSz+len(o.Data))
	be.PutUint64(b[0:], magicOptReply)
	be.PutUint32(b[8:], o.Option)
	be.PutUint32(b[12:], o.Type)
	be.PutUint32(b[16:], uint32(len(o.Data)))
	copy(b[optReplyHeaderSz:], o.Data)
	return b
}

func decodeOptReplyHeader(b []byte) (opt, typ, length uint32, err error) {
	if len(b) < optReplyHeaderSz {
		return 0, 0, 0, fmt.Errorf("%w: short option reply header", ErrProtocol)
	}
	if m := be.Uint64(b[0:]); m != magicOptReply {
		return 0, 0, 0, fmt.Errorf("%w: option reply magic %#x", ErrBadMagic, m)
	}
	return be.Uint32(b[8:]), be.Uint32(b[12:]), be.Uint32(b[16:]), nil
}

func readOptReply(r io.Reader) (optReply, error) {
	var h [optReplyHeaderSz]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return optReply{}, err
	}
	opt, typ, n, err := decodeOptReplyHeader(h[:])
	if err != nil {
		return optReply{}, err
	}
	if n > maxOptionLen {
		return optReply{}, fmt.Errorf("%w: option reply of %d bytes", ErrTooBig, n)
	}
	data := make([]byte, n)
	if _, err := io.ReadFull(r, data); err != nil {
		return optReply{}, err
	}
	return optReply{Option: opt, Type: typ, Data: data}, nil
}

// InfoRequest is the payload of NBD_OPT_INFO and NBD_OPT_GO.
type InfoRequest struct {
	Name  string
	Infos []uint16
}

func (q *InfoRequest) encode() []byte {
	b := make([]byte, 4+len(q.Name)+2+2*len(q.Infos))
	be.PutUint32(b[0:], uint32(len(q.Name)))
	copy(b[4:], q.Name)
	p := 4 + len(q.Name)
	be.PutUint16(b[p:], uint16(len(q.Infos)))
	for i, t := range q.Infos {
		be.PutUint16(b[p+2+2*i:], t)
	}
	return b
}

// decodeInfoRequest parses the payload of NBD_OPT_INFO / NBD_OPT_GO.
func decodeInfoRequest(b []byte) (InfoRequest, error) {
	if len(b) < 4 {
		return InfoRequest{}, fmt.Errorf("%w: info request too short", ErrProtocol)
	}
	n := be.Uint32(b[0:])
	if n > maxNameLen || uint64(n)+6 > uint64(len(b)) {
		return InfoRequest{}, fmt.Errorf("%w: bad name length %d", ErrProtocol, n)
	}
	q := InfoRequest{Name: string(b[4 : 4+n])}
	p := 4 + int(n)
	cnt := int(be.Uint16(b[p:]))
	p += 2
	if len(b)-p != 2*cnt {
		return InfoRequest{}, fmt.Errorf("%w: %d info requests in %d bytes", ErrProtocol, cnt, len(b)-p)
	}
	for i := 0; i < cnt; i++ {
		q.Infos = append(q.Infos, be.Uint16(b[p+2*i:]))
	}
	return q, nil
}

// ExportInfo is what a client learns about an export during negotiation.
type ExportInfo struct {
	Name        string
	Description string
	Size        uint64
	Flags       uint16
	// Block size constraints; zero when the server sent none.
	MinBlock, PrefBlock, MaxBlock uint32
	// Fenced reports that the server took the session option: it fences
	// the connections this one supersedes, and Incarnation is its
	// incarnation. Both are zero with servers that do not know the option.
	Fenced      bool
	Incarnation Incarnation
	// Servers are the storage nodes that hold the export now, when the
	// client asked (NegotiateOptions.AskServers) and the server knows.
	Servers []ServerAddrs
	// Infos are the answers to the information types this package does
	// not know, by type (NegotiateOptions.AskInfos).
	Infos map[uint16][]byte
}

func encodeInfoExport(size uint64, flags uint16) []byte {
	b := make([]byte, 12)
	be.PutUint16(b[0:], InfoExport)
	be.PutUint64(b[2:], size)
	be.PutUint16(b[10:], flags)
	return b
}

func encodeInfoBlockSize(min, pref, max uint32) []byte {
	b := make([]byte, 14)
	be.PutUint16(b[0:], InfoBlockSize)
	be.PutUint32(b[2:], min)
	be.PutUint32(b[6:], pref)
	be.PutUint32(b[10:], max)
	return b
}

func encodeInfoString(typ uint16, s string) []byte {
	b := make([]byte, 2+len(s))
	be.PutUint16(b[0:], typ)
	copy(b[2:], s)
	return b
}

// applyInfo folds one NBD_REP_INFO payload into e. Unknown info types are
// ignored, as the protocol requires.
func (e *ExportInfo) applyInfo(b []byte) error {
	if len(b) < 2 {
		return fmt.Errorf("%w: empty info reply", ErrProtocol)
	}
	switch t := be.Uint16(b[0:]); t {
	case InfoExport:
		if len(b) != 12 {
			return fmt.Errorf("%w: NBD_INFO_EXPORT of %d bytes", ErrProtocol, len(b))
		}
		e.Size = be.Uint64(b[2:])
		e.Flags = be.Uint16(b[10:])
	case InfoBlockSize:
		if len(b) != 14 {
			return fmt.Errorf("%w: NBD_INFO_BLOCK_SIZE of %d bytes", ErrProtocol, len(b))
		}
		e.MinBlock, e.PrefBlock, e.MaxBlock = be.Uint32(b[2:]), be.Uint32(b[6:]), be.Uint32(b[10:])
	case InfoName:
		e.Name = string(b[2:])
	case InfoDescription:
		e.Description = string(b[2:])
	case InfoServers:
		servers, err := decodeInfoServers(b[2:])
		if err != nil {
			return err
		}
		e.Servers = servers
	default:
		if e.Infos == nil {
			e.Infos = map[uint16][]byte{}
		}
		e.Infos[t] = slices.Clone(b[2:])
	}
	return nil
}

// decodeServerReply parses the payload of NBD_REP_SERVER (a LIST entry).
func decodeServerReply(b []byte) (string, error) {
	if len(b) < 4 {
		return "", fmt.Errorf("%w: short NBD_REP_SERVER", ErrProtocol)
	}
	n := be.Uint32(b[0:])
	if uint64(n)+4 > uint64(len(b)) {
		return "", fmt.Errorf("%w: NBD_REP_SERVER name length %d", ErrProtocol, n)
	}
	return string(b[4 : 4+n]), nil
}

func encodeServerReply(name string) []byte {
	b := make([]byte, 4+len(name))
	be.PutUint32(b[0:], uint32(len(name)))
	copy(b[4:], name)
	return b
}
