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

package replica

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// DirtyLog is the record of the chunks of a volume that one replica lacks:
// the changes made since it left the in-sync set, and those it had not
// made durable when it left. A rebuild copies these chunks, and only these,
// to bring the replica back.
//
// A log kept in a file is written ahead: Mark returns once the chunks it
// set are durable in the file, so a primary that crashes and restarts
// finds every chunk whose change it acknowledged without that replica. A
// chunk already set costs nothing; a degraded volume's writes pay one
// small synchronous write of the log the first time they touch a chunk.
//
// The file: an 16-byte header (magic, format version, chunk size) and the
// bitmap, one little-endian 64-bit word per 64 chunks.
type DirtyLog struct {
	mu   sync.Mutex
	set  chunks
	f    *os.File // nil: kept in memory only
	path string
	err  error // a failed write of the log: every later Mark fails
}

const (
	logMagic   = "MPNBDDRT"
	logVersion = 1
	logHeader  = 16
)

// ErrLogCorrupt: a log file that is not one, or of another chunk size.
var ErrLogCorrupt = errors.New("replica: dirty log file is corrupt")

// NewMemoryLog returns a log kept in memory only (lost with the process:
// a restarted primary then rebuilds the replica whole).
func NewMemoryLog() *DirtyLog { return &DirtyLog{} }

// OpenLog opens the log file at path, creating an empty one if there is
// none, and loads what it holds.
func OpenLog(path string) (*DirtyLog, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("replica: opening dirty log: %w", err)
	}
	l := &DirtyLog{f: f, path: path}
	if err := l.load(); err != nil {
		f.Close()
		return nil, err
	}
	return l, nil
}

func (l *DirtyLog) load() error {
	st, err := l.f.Stat()
	if err != nil {
		return err
	}
	if st.Size() == 0 {
		var h [logHeader]byte
		copy(h[:], logMagic)
		binary.LittleEndian.PutUint32(h[8:], logVersion)
		binary.LittleEndian.PutUint32(h[12:], Chunk)
		if _, err := l.f.WriteAt(h[:], 0); err != nil {
			return fmt.Errorf("replica: writing dirty log header: %w", err)
		}
		return l.f.Sync()
	}
	b, err := io.ReadAll(io.NewSectionReader(l.f, 0, st.Size()))
	if err != nil {
		return fmt.Errorf("replica: reading dirty log: %w", err)
	}
	if len(b) < logHeader || string(b[:8]) != logMagic ||
		binary.LittleEndian.Uint32(b[8:]) != logVersion || binary.LittleEndian.Uint32(b[12:]) != Chunk ||
		(len(b)-logHeader)%8 != 0 {
		return fmt.Errorf("%w: %s", ErrLogCorrupt, l.path)
	}
	for i := logHeader; i < len(b); i += 8 {
		l.set.words = append(l.set.words, binary.LittleEndian.Uint64(b[i:]))
	}
	return nil
}

// Mark records that the replica lacks [off, off+n); with a file, it
// returns once that is durable.
func (l *DirtyLog) Mark(off, n int64) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.add(l.set.mark(off, n))
}

// merge records every chunk of c.
func (l *DirtyLog) merge(c *chunks) error {
	if c == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var changed []int
	for i, w := range c.words {
		if i >= len(l.set.words) || l.set.words[i]|w != l.set.words[i] {
			changed = append(changed, i)
		}
	}
	l.set.or(c)
	return l.add(changed)
}

// add writes the changed words to the file and syncs it. Called with mu.
func (l *DirtyLog) add(changed []int) error {
	if l.err != nil {
		return l.err
	}
	if l.f == nil || len(changed) == 0 {
		return nil
	}
	var w [8]byte
	for _, i := range changed {
		binary.LittleEndian.PutUint64(w[:], l.set.words[i])
		if _, err := l.f.WriteAt(w[:], logHeader+int64(i)*8); err != nil {
			l.err = fmt.Errorf("replica: writing dirty log %s: %w", l.path, err)
			return l.err
		}
	}
	if err := l.f.Sync(); err != nil {
		l.err = fmt.Errorf("replica: syncing dirty log %s: %w", l.path, err)
		return l.err
	}
	return nil
}

// Ranges lists what the replica lacks, adjacent chunks merged.
func (l *DirtyLog) Ranges() []nbd.Range {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.set.ranges()
}

// Bytes is how much the replica lacks, in bytes.
func (l *DirtyLog) Bytes() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.set.count() * Chunk
}

// Close closes the log's file; the log stays on disk.
func (l *DirtyLog) Close() error {
	if l.f == nil {
		return nil
	}
	return l.f.Close()
}
