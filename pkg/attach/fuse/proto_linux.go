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

package fuse

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// The FUSE wire protocol as far as the export's file system needs it,
// after the kernel's include/uapi/linux/fuse.h. Every integer is in the
// host's byte order (little endian on every architecture we build for);
// structures are packed as the C compiler lays them out, which needs no
// padding for any of these.

// Protocol version: the kernel and the server agree on the major and on
// the smaller of the two minors. 7.36 is the oldest minor whose
// structures and flags (FOPEN_PARALLEL_DIRECT_WRITES) we rely on.
const (
	protoMajor    = 7
	protoMinor    = 36
	protoMinMinor = 28 // FUSE_MAX_PAGES, to move 1 MiB per request
)

// Operation codes (enum fuse_opcode).
const (
	fuseLookup      = 1
	fuseForget      = 2
	fuseGetattr     = 3
	fuseSetattr     = 4
	fuseOpen        = 14
	fuseRead        = 15
	fuseWrite       = 16
	fuseStatfs      = 17
	fuseRelease     = 18
	fuseFsync       = 20
	fuseFlush       = 25
	fuseInit        = 26
	fuseOpendir     = 27
	fuseReaddir     = 28
	fuseReleasedir  = 29
	fuseInterrupt   = 36
	fuseDestroy     = 38
	fuseBatchForget = 42
	fuseFallocate   = 43
)

// INIT flags (fuse_init_in/out.flags).
const (
	initAsyncRead      = 1 << 0
	initBigWrites      = 1 << 5
	initAsyncDIO       = 1 << 15
	initParallelDirops = 1 << 18
	initMaxPages       = 1 << 22
)

// Open reply flags (fuse_open_out.open_flags).
const (
	fopenDirectIO             = 1 << 0
	fopenParallelDirectWrites = 1 << 6
)

// Other constants of the protocol.
const (
	fattrSize        = 1 << 3 // fuse_setattr_in.valid: size is set
	notifyInvalInode = 2      // enum fuse_notify_code
	pageSize         = 4096
	direntTypeDir    = 4 // DT_DIR
	direntTypeReg    = 8 // DT_REG
)

// Sizes of the structures on the wire.
const (
	inHeaderSize    = 40 // fuse_in_header
	outHeaderSize   = 16 // fuse_out_header
	initInSize      = 16 // fuse_init_in up to flags; 7.36 adds flags2 and room
	initOutSize     = 64 // fuse_init_out
	readInSize      = 40 // fuse_read_in (also READDIR)
	writeInSize     = 40 // fuse_write_in
	setattrInSize   = 88 // fuse_setattr_in
	openInSize      = 8  // fuse_open_in
	fsyncInSize     = 16 // fuse_fsync_in
	fallocateInSize = 32 // fuse_fallocate_in
	attrSize        = 88 // fuse_attr
	attrOutSize     = 16 + attrSize
	entryOutSize    = 40 + attrSize
	openOutSize     = 16
	writeOutSize    = 8
	statfsOutSize   = 80 // fuse_kstatfs
	direntHdrSize   = 24 // fuse_dirent without the name
	notifyInvalSize = 24 // fuse_notify_inval_inode_out
)

var le = binary.LittleEndian

// errMalformed is a request the kernel would not send: too short for its
// operation, or a length field that disagrees with what was read.
var errMalformed = errors.New("fuse: malformed request")

// inHeader is fuse_in_header.
type inHeader struct {
	Len         uint32
	Opcode      uint32
	Unique      uint64
	NodeID      uint64
	UID, GID    uint32
	PID         uint32
	TotalExtLen uint16 // extensions after the arguments, in 8-byte units
}

// request is one request read from /dev/fuse: the header and the
// operation's arguments (for WRITE followed by the data). It aliases the
// buffer it was read into.
type request struct {
	hdr inHeader
	arg []byte
}

// parseRequest splits a request as read (exactly one per read(2)).
func parseRequest(b []byte) (request, error) {
	var r request
	if len(b) < inHeaderSize {
		return r, fmt.Errorf("%w: %d bytes", errMalformed, len(b))
	}
	h := &r.hdr
	h.Len = le.Uint32(b[0:])
	h.Opcode = le.Uint32(b[4:])
	h.Unique = le.Uint64(b[8:])
	h.NodeID = le.Uint64(b[16:])
	h.UID = le.Uint32(b[24:])
	h.GID = le.Uint32(b[28:])
	h.PID = le.Uint32(b[32:])
	h.TotalExtLen = le.Uint16(b[36:])
	if int64(h.Len) != int64(len(b)) {
		return r, fmt.Errorf("%w: length %d, read %d", errMalformed, h.Len, len(b))
	}
	arg := b[inHeaderSize:]
	ext := int(h.TotalExtLen) * 8
	if ext > len(arg) {
		return r, fmt.Errorf("%w: %d bytes of extensions in %d", errMalformed, ext, len(arg))
	}
	r.arg = arg[:len(arg)-ext]
	return r, nil
}

// initIn is fuse_init_in.
type initIn struct {
	Major, Minor uint32
	MaxReadahead uint32
	Flags        uint32
}

func decodeInit(arg []byte) (initIn, error) {
	if len(arg) < 8 {
		return initIn{}, errMalformed
	}
	in := initIn{Major: le.Uint32(arg[0:]), Minor: le.Uint32(arg[4:])}
	// Before 7.6 the structure ended after the version.
	if len(arg) >= initInSize {
		in.MaxReadahead = le.Uint32(arg[8:])
		in.Flags = le.Uint32(arg[12:])
	}
	return in, nil
}

// initParams is what INIT negotiated; a process that takes the
// connection over serves it with these.
type initParams struct {
	Minor         uint32 `json:"minor"`
	Flags         uint32 `json:"flags"`
	MaxReadahead  uint32 `json:"max_readahead"`
	MaxWrite      uint32 `json:"max_write"`
	MaxBackground uint16 `json:"max_background"`
}

// encodeInitOut is fuse_init_out for p.
func encodeInitOut(p initParams) []byte {
	b := make([]byte, initOutSize)
	le.PutUint32(b[0:], protoMajor)
	le.PutUint32(b[4:], p.Minor)
	le.PutUint32(b[8:], p.MaxReadahead)
	le.PutUint32(b[12:], p.Flags)
	le.PutUint16(b[16:], p.MaxBackground)
	le.PutUint16(b[18:], p.MaxBackground*3/4) // congestion threshold
	le.PutUint32(b[20:], p.MaxWrite)
	le.PutUint32(b[24:], 1) // time granularity: nanoseconds
	le.PutUint16(b[28:], uint16((p.MaxWrite+pageSize-1)/pageSize))
	return b
}

// readIn is fuse_read_in (READ, READDIR).
type readIn struct {
	Fh     uint64
	Offset uint64
	Size   uint32
}

func decodeRead(arg []byte) (readIn, error) {
	if len(arg) < readInSize {
		return readIn{}, errMalformed
	}
	return readIn{Fh: le.Uint64(arg[0:]), Offset: le.Uint64(arg[8:]), Size: le.Uint32(arg[16:])}, nil
}

// writeIn is fuse_write_in and the data after it.
type writeIn struct {
	Fh     uint64
	Offset uint64
	Data   []byte
}

func decodeWrite(arg []byte) (writeIn, error) {
	if len(arg) < writeInSize {
		return writeIn{}, errMalformed
	}
	size := le.Uint32(arg[16:])
	data := arg[writeInSize:]
	if uint64(size) > uint64(len(data)) {
		return writeIn{}, errMalformed
	}
	return writeIn{Fh: le.Uint64(arg[0:]), Offset: le.Uint64(arg[8:]), Data: data[:size]}, nil
}

// setattrIn is the part of fuse_setattr_in the file looks at.
type setattrIn struct {
	Valid uint32
	Size  uint64
}

func decodeSetattr(arg []byte) (setattrIn, error) {
	if len(arg) < setattrInSize {
		return setattrIn{}, errMalformed
	}
	return setattrIn{Valid: le.Uint32(arg[0:]), Size: le.Uint64(arg[16:])}, nil
}

// decodeOpen returns fuse_open_in.flags.
func decodeOpen(arg []byte) (uint32, error) {
	if len(arg) < openInSize {
		return 0, errMalformed
	}
	return le.Uint32(arg[0:]), nil
}

// fallocateIn is fuse_fallocate_in.
type fallocateIn struct {
	Fh     uint64
	Offset uint64
	Length uint64
	Mode   uint32
}

func decodeFallocate(arg []byte) (fallocateIn, error) {
	if len(arg) < fallocateInSize {
		return fallocateIn{}, errMalformed
	}
	return fallocateIn{
		Fh:     le.Uint64(arg[0:]),
		Offset: le.Uint64(arg[8:]),
		Length: le.Uint64(arg[16:]),
		Mode:   le.Uint32(arg[24:]),
	}, nil
}

// decodeName returns the NUL-terminated name LOOKUP carries.
func decodeName(arg []byte) (string, error) {
	for i, c := range arg {
		if c == 0 {
			return string(arg[:i]), nil
		}
	}
	return "", errMalformed
}

// attr is fuse_attr.
type attr struct {
	Ino, Size, Blocks uint64
	Time              uint64 // atime = mtime = ctime
	TimeNsec          uint32
	Mode, Nlink       uint32
	Blksize           uint32
}

func putAttr(b []byte, a attr) {
	le.PutUint64(b[0:], a.Ino)
	le.PutUint64(b[8:], a.Size)
	le.PutUint64(b[16:], a.Blocks)
	for i := 0; i < 3; i++ {
		le.PutUint64(b[24+8*i:], a.Time)
		le.PutUint32(b[48+4*i:], a.TimeNsec)
	}
	le.PutUint32(b[60:], a.Mode)
	le.PutUint32(b[64:], a.Nlink)
	// uid, gid, rdev stay 0 (root's), as does flags.
	le.PutUint32(b[80:], a.Blksize)
}

// encodeAttrOut is fuse_attr_out, valid for ttl seconds.
func encodeAttrOut(a attr, ttl uint64) []byte {
	b := make([]byte, attrOutSize)
	le.PutUint64(b[0:], ttl)
	putAttr(b[16:], a)
	return b
}

// encodeEntryOut is fuse_entry_out for node a.Ino.
func encodeEntryOut(a attr, ttl uint64) []byte {
	b := make([]byte, entryOutSize)
	le.PutUint64(b[0:], a.Ino)
	le.PutUint64(b[8:], 1) // generation: ids are never reused
	le.PutUint64(b[16:], ttl)
	le.PutUint64(b[24:], ttl)
	putAttr(b[40:], a)
	return b
}

func encodeOpenOut(flags uint32) []byte {
	b := make([]byte, openOutSize)
	le.PutUint32(b[8:], flags) // fh 0: handles carry no state
	return b
}

func encodeWriteOut(n uint32) []byte {
	b := make([]byte, writeOutSize)
	le.PutUint32(b, n)
	return b
}

// encodeStatfsOut is fuse_kstatfs for a file system of blocks blocks of
// bsize bytes, all in use.
func encodeStatfsOut(blocks uint64, bsize uint32) []byte {
	b := make([]byte, statfsOutSize)
	le.PutUint64(b[0:], blocks)
	le.PutUint64(b[24:], 2) // files: the root and the export
	le.PutUint32(b[40:], bsize)
	le.PutUint32(b[44:], 255) // namelen
	le.PutUint32(b[48:], bsize)
	return b
}

// dirent is one entry of a READDIR reply.
type dirent struct {
	Ino  uint64
	Type uint32
	Name string
}

// encodeDirents appends the entries of ents from index off on, as many as
// fit in size bytes; each one's offset is the index of the next.
func encodeDirents(ents []dirent, off uint64, size uint32) []byte {
	var b []byte
	for i := off; i < uint64(len(ents)); i++ {
		e := ents[i]
		n := (direntHdrSize + len(e.Name) + 7) &^ 7
		if len(b)+n > int(size) {
			break
		}
		d := make([]byte, n)
		le.PutUint64(d[0:], e.Ino)
		le.PutUint64(d[8:], i+1)
		le.PutUint32(d[16:], uint32(len(e.Name)))
		le.PutUint32(d[20:], e.Type)
		copy(d[direntHdrSize:], e.Name)
		b = append(b, d...)
	}
	return b
}

// putOutHeader writes fuse_out_header into b: a reply of n bytes in all
// to request unique, with errno (positive) or 0.
func putOutHeader(b []byte, n int, errno int32, unique uint64) {
	le.PutUint32(b[0:], uint32(n))
	le.PutUint32(b[4:], uint32(-errno))
	le.PutUint64(b[8:], unique)
}

// encodeNotifyInvalInode is the FUSE_NOTIFY_INVAL_INODE message for
// node ino: off -1 drops only the attributes.
func encodeNotifyInvalInode(ino uint64, off, length int64) []byte {
	b := make([]byte, outHeaderSize+notifyInvalSize)
	le.PutUint32(b[0:], uint32(len(b)))
	le.PutUint32(b[4:], notifyInvalInode) // a notification: the code in error, unique 0
	le.PutUint64(b[16:], ino)
	le.PutUint64(b[24:], uint64(off))
	le.PutUint64(b[32:], uint64(length))
	return b
}
