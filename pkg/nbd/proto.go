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

// Package nbd implements the Network Block Device protocol (fixed newstyle
// negotiation and the simple-reply transmission phase) for both sides: a
// pipelined server for many exports and connections, and a pipelined client.
//
// The package knows nothing about MPTCP or Kubernetes: MPTCP comes from how
// the caller made its listener or dialer.
package nbd

import (
	"errors"
	"fmt"
)

// Magic numbers of the handshake and transmission phases.
const (
	magicNBD          uint64 = 0x4e42444d41474943 // "NBDMAGIC"
	magicIHaveOpt     uint64 = 0x49484156454f5054 // "IHAVEOPT"
	magicOptReply     uint64 = 0x0003e889045565a9
	magicRequest      uint32 = 0x25609513
	magicSimpleReply  uint32 = 0x67446698
	requestHeaderSize        = 28
	replyHeaderSize          = 16
	optHeaderSize            = 16
	optReplyHeaderSz         = 20
)

// Handshake flags (server) and client flags.
const (
	flagFixedNewstyle uint16 = 1 << 0
	flagNoZeroes      uint16 = 1 << 1

	clientFlagFixedNewstyle uint32 = 1 << 0
	clientFlagNoZeroes      uint32 = 1 << 1
)

// Option codes.
const (
	OptExportName      uint32 = 1
	OptAbort           uint32 = 2
	OptList            uint32 = 3
	OptPeekExport      uint32 = 4
	OptStartTLS        uint32 = 5
	OptInfo            uint32 = 6
	OptGo              uint32 = 7
	OptStructuredReply uint32 = 8
	OptListMetaContext uint32 = 9
	OptSetMetaContext  uint32 = 10
	OptExtendedHeaders uint32 = 11
)

// Option reply types. Errors have bit 31 set.
const (
	RepAck         uint32 = 1
	RepServer      uint32 = 2
	RepInfo        uint32 = 3
	repErrBit      uint32 = 1 << 31
	RepErrUnsup           = repErrBit | 1
	RepErrPolicy          = repErrBit | 2
	RepErrInvalid         = repErrBit | 3
	RepErrPlatform        = repErrBit | 4
	RepErrTLSReqd         = repErrBit | 5
	RepErrUnknown         = repErrBit | 6
	RepErrShutdown        = repErrBit | 7
	RepErrBlockReq        = repErrBit | 8
	RepErrTooBig          = repErrBit | 9
)

// Information types carried by NBD_REP_INFO.
const (
	InfoExport      uint16 = 0
	InfoName        uint16 = 1
	InfoDescription uint16 = 2
	InfoBlockSize   uint16 = 3
)

// Transmission flags, announced per export.
const (
	FlagHasFlags        uint16 = 1 << 0
	FlagReadOnly        uint16 = 1 << 1
	FlagSendFlush       uint16 = 1 << 2
	FlagSendFUA         uint16 = 1 << 3
	FlagRotational      uint16 = 1 << 4
	FlagSendTrim        uint16 = 1 << 5
	FlagSendWriteZeroes uint16 = 1 << 6
	FlagSendDF          uint16 = 1 << 7
	FlagCanMultiConn    uint16 = 1 << 8
)

// Commands.
const (
	CmdRead        uint16 = 0
	CmdWrite       uint16 = 1
	CmdDisc        uint16 = 2
	CmdFlush       uint16 = 3
	CmdTrim        uint16 = 4
	CmdCache       uint16 = 5
	CmdWriteZeroes uint16 = 6
	CmdBlockStatus uint16 = 7
)

// Command flags.
const (
	CmdFlagFUA    uint16 = 1 << 0
	CmdFlagNoHole uint16 = 1 << 1
)

// Error values carried in replies (they are not the host's errno numbers).
const (
	EPERM     uint32 = 1
	EIO       uint32 = 5
	ENOMEM    uint32 = 12
	EINVAL    uint32 = 22
	ENOSPC    uint32 = 28
	EOVERFLOW uint32 = 75
	ENOTSUP   uint32 = 95
	ESHUTDOWN uint32 = 108
)

// MaxRequestSize bounds the payload of one request. The kernel client never
// sends more than 32 MiB; anything larger is refused so that a peer cannot
// make either side allocate without bound.
const MaxRequestSize = 32 << 20

// Limits on handshake data we accept from a peer.
const (
	maxOptionLen = 64 << 10 // option payloads are small; names are <= 4096 bytes
	maxNameLen   = 4096
)

// Sentinel errors. Lower layers wrap them; callers use errors.Is.
var (
	ErrBadMagic        = errors.New("nbd: bad magic")
	ErrNotFixed        = errors.New("nbd: peer does not speak fixed newstyle")
	ErrUnknownExport   = errors.New("nbd: unknown export")
	ErrAccessDenied    = errors.New("nbd: access denied")
	ErrUnsupported     = errors.New("nbd: unsupported")
	ErrProtocol        = errors.New("nbd: protocol violation")
	ErrTooBig          = errors.New("nbd: request too big")
	ErrClosed          = errors.New("nbd: connection closed")
	ErrAborted         = errors.New("nbd: negotiation aborted")
	ErrExportExists    = errors.New("nbd: export already exists")
	ErrOutOfRange      = errors.New("nbd: request outside the export")
	ErrReadOnly        = errors.New("nbd: export is read-only")
	ErrNegotiationDone = errors.New("nbd: negotiation already finished")
	ErrUnaligned       = errors.New("nbd: request not aligned to the minimum block size")
	ErrTLSRequired     = errors.New("nbd: TLS required")
	ErrTLSHandshake    = errors.New("nbd: TLS handshake failed")
)

// Error is an error reply from the peer for one command.
type Error struct {
	Cmd   uint16
	Errno uint32
}

func (e *Error) Error() string {
	return fmt.Sprintf("nbd: %s failed: %s", CmdName(e.Cmd), ErrnoName(e.Errno))
}

// OptionError is an error reply to a negotiation option.
type OptionError struct {
	Option uint32
	Reply  uint32
	Msg    string
}

func (e *OptionError) Error() string {
	s := fmt.Sprintf("nbd: option %s refused: %s", OptName(e.Option), RepName(e.Reply))
	if e.Msg != "" {
		s += ": " + e.Msg
	}
	return s
}

// Is lets errors.Is match option refusals against the sentinels.
func (e *OptionError) Is(target error) bool {
	switch target {
	case ErrUnknownExport:
		return e.Reply == RepErrUnknown
	case ErrAccessDenied:
		return e.Reply == RepErrPolicy
	case ErrSuperseded:
		return isSupersededReply(e.Reply, e.Msg)
	case ErrUnsupported:
		return e.Reply == RepErrUnsup
	case ErrTLSRequired:
		return e.Reply == RepErrTLSReqd
	}
	return false
}

// CmdName names a command for logs and metrics.
func CmdName(c uint16) string {
	switch c {
	case CmdRead:
		return "read"
	case CmdWrite:
		return "write"
	case CmdDisc:
		return "disc"
	case CmdFlush:
		return "flush"
	case CmdTrim:
		return "trim"
	case CmdCache:
		return "cache"
	case CmdWriteZeroes:
		return "write_zeroes"
	case CmdBlockStatus:
		return "block_status"
	case CmdSettle:
		return "settle"
	}
	return fmt.Sprintf("cmd(%d)", c)
}

// OptName names a negotiation option.
func OptName(o uint32) string {
	switch o {
	case OptExportName:
		return "EXPORT_NAME"
	case OptAbort:
		return "ABORT"
	case OptList:
		return "LIST"
	case OptPeekExport:
		return "PEEK_EXPORT"
	case OptStartTLS:
		return "STARTTLS"
	case OptInfo:
		return "INFO"
	case OptGo:
		return "GO"
	case OptStructuredReply:
		return "STRUCTURED_REPLY"
	case OptListMetaContext:
		return "LIST_META_CONTEXT"
	case OptSetMetaContext:
		return "SET_META_CONTEXT"
	case OptExtendedHeaders:
		return "EXTENDED_HEADERS"
	case OptSession:
		return "MPNBD_SESSION"
	}
	return fmt.Sprintf("opt(%d)", o)
}

// RepName names an option reply type.
func RepName(r uint32) string {
	switch r {
	case RepAck:
		return "ACK"
	case RepServer:
		return "SERVER"
	case RepInfo:
		return "INFO"
	case RepErrUnsup:
		return "ERR_UNSUP"
	case RepErrPolicy:
		return "ERR_POLICY"
	case RepErrInvalid:
		return "ERR_INVALID"
	case RepErrPlatform:
		return "ERR_PLATFORM"
	case RepErrTLSReqd:
		return "ERR_TLS_REQD"
	case RepErrUnknown:
		return "ERR_UNKNOWN"
	case RepErrShutdown:
		return "ERR_SHUTDOWN"
	case RepErrBlockReq:
		return "ERR_BLOCK_SIZE_REQD"
	case RepErrTooBig:
		return "ERR_TOO_BIG"
	}
	return fmt.Sprintf("rep(%#x)", r)
}

// ErrnoName names a reply error value.
func ErrnoName(e uint32) string {
	switch e {
	case 0:
		return "ok"
	case EPERM:
		return "EPERM"
	case EIO:
		return "EIO"
	case ENOMEM:
		return "ENOMEM"
	case EINVAL:
		return "EINVAL"
	case ENOSPC:
		return "ENOSPC"
	case EOVERFLOW:
		return "EOVERFLOW"
	case ENOTSUP:
		return "ENOTSUP"
	case ESHUTDOWN:
		return "ESHUTDOWN"
	}
	return fmt.Sprintf("errno(%d)", e)
}
