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
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// The control socket of a server process carries one JSON request and one
// JSON response per connection.

// Operations of the control socket.
const (
	opStatus = "status" // the attachment, for adoption and readiness
	opHealth = "health"
	opResize = "resize"
	opDetach = "detach" // tear down, then exit
	// opHandoff quiesces the volume and answers with the handoff and its
	// files; the connection stays open for opResume or opRelease.
	opHandoff = "handoff"
	opResume  = "resume"  // serve again
	opRelease = "release" // the successor serves: exit, leaving everything
)

type ctlRequest struct {
	Op string `json:"op"`
	// Size is, for resize, the size the export must have at least.
	Size uint64 `json:"size,omitempty"`
	// UnmountTimeout is, for detach, Config.UnmountTimeout of the
	// detaching Attacher.
	UnmountTimeout time.Duration `json:"unmount_timeout,omitempty"`
}

type ctlResponse struct {
	Pid        int                `json:"pid"`
	StartTime  uint64             `json:"start_time"`
	Attachment *attach.Attachment `json:"attachment,omitempty"`
	Health     *attach.Health     `json:"health,omitempty"`
	Size       uint64             `json:"size,omitempty"`
	Handoff    *handoffMsg        `json:"handoff,omitempty"`
	Error      *attach.WireError  `json:"error,omitempty"`
}

// callServer sends one request to the control socket at sock and reads
// the response. The error is about the exchange; what the server reports
// is in the response's Error. timeout, if positive, bounds the exchange
// besides ctx.
func callServer(ctx context.Context, sock string, req ctlRequest, timeout time.Duration) (*ctlResponse, error) {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := json.NewEncoder(c).Encode(req); err != nil {
		return nil, ctxError(ctx, err)
	}
	var resp ctlResponse
	if err := json.NewDecoder(c).Decode(&resp); err != nil {
		return nil, ctxError(ctx, err)
	}
	return &resp, nil
}

// ctxError prefers the context's error to the I/O error it caused.
func ctxError(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%w (%v)", cerr, err)
	}
	return err
}

// listenControl listens on the control socket at path, mode 0600. A file
// left there by a dead server is removed first: the caller holds the
// volume's lock, so no live server owns it.
func listenControl(path string) (*net.UnixListener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	ln.SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		os.Remove(path)
		return nil, err
	}
	return ln, nil
}

// checkPeer accepts root and this process's own user on the other end.
func checkPeer(c net.Conn) error {
	uid, pid, err := attach.PeerCred(c)
	if err != nil {
		return err
	}
	if uid != 0 && int(uid) != os.Geteuid() {
		return fmt.Errorf("peer uid %d (pid %d) is neither root nor %d", uid, pid, os.Geteuid())
	}
	return nil
}
