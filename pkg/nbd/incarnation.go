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
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// IncarnationStore makes a server's incarnation change when writes it
// acknowledged may have been lost although the host did not reboot: a
// sync that failed as an export was closed (at a server's shutdown, or
// when the export was removed) consumed the backend's writeback error, and
// no client is connected to be told (exportSyncs tells those that are).
// Clients that reconnect later must then send again what they retained
// (pkg/relay does so when the incarnation differs), and a new incarnation
// is how the server says so.
//
// The incarnation is BootIncarnation mixed with a random salt kept in the
// file at Path; without the file it is BootIncarnation itself. Lost
// writes a new salt, so the change outlives a restart of the server on
// the same boot; with Path empty nothing is written, and the change lasts
// as long as the process. Path should be on the disk that holds the exports: a
// host that cannot write it there cannot write the exports either.
type IncarnationStore struct {
	Path string
}

const incarnationSaltLen = 16

// Current returns the incarnation to announce now.
func (st IncarnationStore) Current() (Incarnation, error) {
	boot, err := BootIncarnation()
	if err != nil {
		return Incarnation{}, err
	}
	if st.Path == "" {
		return boot, nil
	}
	salt, err := os.ReadFile(st.Path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return boot, nil
	case err != nil:
		return Incarnation{}, fmt.Errorf("incarnation salt: %w", err)
	case len(salt) != incarnationSaltLen:
		return Incarnation{}, fmt.Errorf("incarnation salt %s: %d bytes, want %d", st.Path, len(salt), incarnationSaltLen)
	}
	return saltedIncarnation(boot, salt), nil
}

// Lost records that acknowledged writes may have been lost and returns
// the new incarnation to announce (also when it could not be recorded:
// then with the error, and the change lasts only as long as the process).
func (st IncarnationStore) Lost() (Incarnation, error) {
	salt := make([]byte, incarnationSaltLen)
	rand.Read(salt)
	boot, err := BootIncarnation()
	if err != nil {
		// Without a boot ID the process's own incarnation changes at
		// every restart already; a random one is new all the same.
		var inc Incarnation
		copy(inc[:], salt)
		return inc, err
	}
	inc := saltedIncarnation(boot, salt)
	if st.Path == "" {
		return inc, nil
	}
	return inc, writeFileSynced(st.Path, salt)
}

func saltedIncarnation(boot Incarnation, salt []byte) Incarnation {
	h := sha256.New()
	h.Write([]byte("mpnbd lost writes\x00"))
	h.Write(boot[:])
	h.Write(salt)
	var inc Incarnation
	copy(inc[:], h.Sum(nil))
	return inc
}

// writeFileSynced replaces path with data, durably: a temporary file
// synced, renamed over path, and the directory synced.
func writeFileSynced(path string, data []byte) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, ".incarnation-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// SetIncarnation changes the incarnation announced to sessions that
// negotiate from now on; connections already open keep theirs.
func (s *Server) SetIncarnation(inc Incarnation) {
	s.mu.Lock()
	s.Incarnation = inc
	s.mu.Unlock()
}
