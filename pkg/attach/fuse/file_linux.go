package fuse

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// blockIO is the part of *nbd.Client the file needs.
type blockIO interface {
	ReadAt(p []byte, off int64) (int, error)
	WriteAt(p []byte, off int64) (int, error)
	Flush() error
	WriteZeroes(off, length int64, noHole bool) error
}

// rootDir is the mount's root directory; it holds the export file.
type rootDir struct {
	fusefs.Inode
	name string
	file *exportFile
}

var _ = (fusefs.NodeOnAdder)((*rootDir)(nil))

func (r *rootDir) OnAdd(ctx context.Context) {
	ch := r.NewPersistentInode(ctx, r.file, fusefs.StableAttr{Mode: unix.S_IFREG, Ino: 2})
	r.AddChild(r.name, ch, false)
}

// exportFile is the regular file whose bytes are the export's.
type exportFile struct {
	fusefs.Inode

	bio       blockIO
	size      atomic.Uint64
	readOnly  bool
	canZero   bool // the server accepts NBD_CMD_WRITE_ZEROES
	openFlags uint32
	mtime     time.Time
	log       *slog.Logger

	// lastErr is the last transport error (connection lost), for Health.
	lastErr atomic.Pointer[error]
}

var (
	_ = (fusefs.NodeGetattrer)((*exportFile)(nil))
	_ = (fusefs.NodeSetattrer)((*exportFile)(nil))
	_ = (fusefs.NodeOpener)((*exportFile)(nil))
	_ = (fusefs.NodeReader)((*exportFile)(nil))
	_ = (fusefs.NodeWriter)((*exportFile)(nil))
	_ = (fusefs.NodeFsyncer)((*exportFile)(nil))
	_ = (fusefs.NodeFlusher)((*exportFile)(nil))
	_ = (fusefs.NodeAllocater)((*exportFile)(nil))
)

func (f *exportFile) fillAttr(a *gofuse.Attr) {
	mode := uint32(0o600)
	if f.readOnly {
		mode = 0o400
	}
	size := f.size.Load()
	a.Mode = unix.S_IFREG | mode
	a.Nlink = 1
	a.Size = size
	a.Blocks = (size + 511) / 512
	a.Blksize = 4096
	a.SetTimes(nil, &f.mtime, &f.mtime)
}

func (f *exportFile) Getattr(ctx context.Context, fh fusefs.FileHandle, out *gofuse.AttrOut) syscall.Errno {
	f.fillAttr(&out.Attr)
	return 0
}

// Setattr accepts everything but a size change: the export's size is the
// server's to decide.
func (f *exportFile) Setattr(ctx context.Context, fh fusefs.FileHandle, in *gofuse.SetAttrIn, out *gofuse.AttrOut) syscall.Errno {
	if sz, ok := in.GetSize(); ok && sz != f.size.Load() {
		return syscall.EPERM
	}
	f.fillAttr(&out.Attr)
	return 0
}

func (f *exportFile) Open(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	if f.readOnly && flags&unix.O_ACCMODE != unix.O_RDONLY {
		return nil, 0, syscall.EROFS
	}
	return nil, f.openFlags, 0
}

func (f *exportFile) Read(ctx context.Context, fh fusefs.FileHandle, dest []byte, off int64) (gofuse.ReadResult, syscall.Errno) {
	size := int64(f.size.Load())
	if off < 0 {
		return nil, syscall.EINVAL
	}
	if off >= size {
		return gofuse.ReadResultData(nil), 0
	}
	n := min(int64(len(dest)), size-off)
	if _, err := f.bio.ReadAt(dest[:n], off); err != nil {
		return nil, f.errno("read", err)
	}
	return gofuse.ReadResultData(dest[:n]), 0
}

func (f *exportFile) Write(ctx context.Context, fh fusefs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	if f.readOnly {
		return 0, syscall.EROFS
	}
	size := int64(f.size.Load())
	if off < 0 {
		return 0, syscall.EINVAL
	}
	if off >= size {
		return 0, syscall.ENOSPC
	}
	// A write running past the end is cut short at the end.
	n := min(int64(len(data)), size-off)
	if _, err := f.bio.WriteAt(data[:n], off); err != nil {
		return 0, f.errno("write", err)
	}
	return uint32(n), 0
}

func (f *exportFile) Fsync(ctx context.Context, fh fusefs.FileHandle, flags uint32) syscall.Errno {
	if f.readOnly {
		return 0
	}
	if err := f.bio.Flush(); err != nil {
		return f.errno("flush", err)
	}
	return 0
}

// Flush is close(2); durability is fsync's business.
func (f *exportFile) Flush(ctx context.Context, fh fusefs.FileHandle) syscall.Errno {
	return 0
}

// Allocate maps fallocate(2) to the NBD commands. Both punching a hole and
// zeroing a range must read back as zeroes afterwards, which only
// NBD_CMD_WRITE_ZEROES promises (the content of a trimmed range is
// unspecified by the protocol): punch hole lets the server deallocate,
// zero range (what the loop driver uses for REQ_NOUNMAP) does not. Plain
// allocation inside the file is a no-op; the file cannot grow.
func (f *exportFile) Allocate(ctx context.Context, fh fusefs.FileHandle, off, length uint64, mode uint32) syscall.Errno {
	if f.readOnly {
		return syscall.EROFS
	}
	size := f.size.Load()
	end := off + length
	if end < off {
		return syscall.EINVAL
	}
	switch mode &^ unix.FALLOC_FL_KEEP_SIZE {
	case 0:
		if end > size && mode&unix.FALLOC_FL_KEEP_SIZE == 0 {
			return syscall.EOPNOTSUPP
		}
		return 0
	case unix.FALLOC_FL_PUNCH_HOLE, unix.FALLOC_FL_ZERO_RANGE:
	default:
		return syscall.EOPNOTSUPP
	}
	if !f.canZero {
		return syscall.EOPNOTSUPP
	}
	if off >= size {
		return 0
	}
	end = min(end, size)
	noHole := mode&unix.FALLOC_FL_ZERO_RANGE != 0
	if err := f.bio.WriteZeroes(int64(off), int64(end-off), noHole); err != nil {
		return f.errno("write-zeroes", err)
	}
	return 0
}

// errno turns a client error into the errno the kernel passes on, and
// remembers transport failures.
func (f *exportFile) errno(op string, err error) syscall.Errno {
	var ne *nbd.Error
	switch {
	case errors.As(err, &ne):
		switch ne.Errno {
		case nbd.EPERM:
			return syscall.EPERM
		case nbd.ENOMEM:
			return syscall.ENOMEM
		case nbd.EINVAL:
			return syscall.EINVAL
		case nbd.ENOSPC:
			return syscall.ENOSPC
		case nbd.EOVERFLOW:
			return syscall.EOVERFLOW
		case nbd.ENOTSUP:
			return syscall.EOPNOTSUPP
		}
		return syscall.EIO
	case errors.Is(err, nbd.ErrUnaligned):
		return syscall.EINVAL
	}
	if f.lastErr.Swap(&err) == nil {
		f.log.Error("fuse: NBD connection failed; I/O to the device fails until it is reattached", "op", op, "err", err)
	}
	return syscall.EIO
}
