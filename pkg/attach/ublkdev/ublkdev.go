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

// Package ublkdev attaches exports as /dev/ublkbN: the ublk transport. A
// device's I/O is served through the volume's NBD session (attach.Session:
// every storage address in turn, redial, replay, retention), over MPTCP
// end to end with no relay hop and no loop device. Devices are made with
// ublk's user recovery: when the process serving one dies the kernel keeps
// the device and holds its I/O, and the next process takes it over from
// the state directory, continuing the volume's session.
//
// # One server process per volume
//
// Supervisor, the transport the node uses, serves each volume from a
// process of its own (Config.ServeCommand, by default this executable
// again: ServeRequested and ServeMain), which runs an Attacher for that one
// volume. The supervisor talks to it over a socket pair (descriptor 3 of
// the process): the volume to serve first, then health, resize, handoff,
// release and detach requests, each answered by ID. When a volume's
// process dies (a crash, an OOM kill, a SIGKILL) the kernel holds the
// device's I/O and the supervisor starts a new process that takes the
// device over: a pause, no error. Restarts back off (up to maxBackoff
// apart), so a process that keeps crashing stalls its own volume and
// no other. A process whose supervisor goes away (the socket closes)
// stops its queues, flushes, and exits, leaving its device held by the
// kernel for the next supervisor's Adopt; every process of a restarted
// container goes this way.
//
// # Acknowledged writes at the end of a process
//
// The session keeps every write it acknowledged until a FLUSH covers it;
// those writes exist only in the process until then. A release (a
// handoff, the supervisor gone) ends the queues first, so that nothing
// more is acknowledged, then flushes until a FLUSH succeeds, through an
// outage and a new incarnation of the storage node, bounded only by the
// volume's outage policy (DeadConnTimeout when set; none for a hard
// mount), and only then closes the session: a successor starts once the
// release is over. A detach flushes before it deletes the device, within
// the caller's context; with the storage node away it fails with
// attach.ErrUnflushed and leaves the volume attached and served, and the
// caller's retry (kubelet retries NodeUnstage) finishes it once the node
// is back. Failing beats both alternatives: reporting success would drop
// the writes (lost for good if the node lost its cache), and waiting
// without bound would hold a CSI call past its deadline.
//
// Attacher serves volumes in the process that calls it: the engine of a
// volume's process, and a transport of its own for tools and tests.
package ublkdev

import (
	"encoding/json"
	"log/slog"
	"os"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Config configures an Attacher or a Supervisor.
type Config struct {
	// StateDir keeps one file per attached volume, for Adopt.
	StateDir string
	// Queues and Depth of each device (zero: one queue per CPU up to 4,
	// 64 requests each).
	Queues, Depth int
	// ServeCommand starts a Supervisor's volume process: the program and
	// its arguments. It runs with ServeEnv=1 in its environment and the
	// supervisor's socket as descriptor 3, and must end in ServeMain, like
	// a main that starts with
	//
	//	if ublkdev.ServeRequested() {
	//		os.Exit(ublkdev.ServeMain())
	//	}
	//
	// Empty means the running executable with ServeArg. A wrapper that
	// execs the program keeps the descriptor (nsenter --net=PATH, to dial
	// from another network namespace).
	ServeCommand []string
	Logger       *slog.Logger
}

// ServeEnv tells a process started by a Supervisor to serve a volume.
const ServeEnv = "MPNBD_UBLK_SERVE"

// ServeArg follows the executable in the default ServeCommand, so that
// volume processes stand out in ps.
const ServeArg = "ublk-serve"

// ServeRequested reports whether this process was started to serve a
// volume, in which case main should exit with ServeMain's result before
// doing anything else.
func ServeRequested() bool { return os.Getenv(ServeEnv) == "1" }

// record is what a state file keeps about an attached volume.
type record struct {
	Target  attach.Target  `json:"target"`
	Options attach.Options `json:"options"`
	DevID   uint32         `json:"dev_id"`
	Session nbd.SessionID  `json:"session"`
}

// How a volume process comes to serve its volume (serveSpec.Mode).
const (
	// modeAttach: Attach (a new device, or the state file's taken over).
	modeAttach = "attach"
	// modeRecover: take over the device of the state file, nothing else.
	modeRecover = "recover"
	// modeHandoff: take over a device a live predecessor handed off
	// (serveSpec.Record), once it has stopped serving it.
	modeHandoff = "handoff"
)

// serveSpec is the first message of a volume process's socket.
type serveSpec struct {
	Mode     string          `json:"mode"`
	Target   attach.Target   `json:"target"`
	Options  attach.Options  `json:"options"`
	Record   json.RawMessage `json:"record,omitempty"`
	StateDir string          `json:"state_dir"`
	Queues   int             `json:"queues"`
	Depth    int             `json:"depth"`
	// Deadline bounds the start.
	Deadline time.Time `json:"deadline"`
}

// readyMsg is the volume process's answer to the spec.
type readyMsg struct {
	Pid        int                `json:"pid"`
	Attachment *attach.Attachment `json:"attachment,omitempty"`
	Error      *attach.WireError  `json:"error,omitempty"`
}

// Operations of a volume process.
const (
	opHealth  = "health"
	opResize  = "resize"
	opHandoff = "handoff" // flush, and answer with the handoff's state
	opResume  = "resume"  // the handoff was called off
	opRelease = "release" // stop serving, leave the device, exit
	opDetach  = "detach"  // remove the device, exit
)

type request struct {
	ID   uint64 `json:"id"`
	Op   string `json:"op"`
	Size uint64 `json:"size,omitempty"`
}

type response struct {
	ID      uint64            `json:"id"`
	Health  *attach.Health    `json:"health,omitempty"`
	Size    uint64            `json:"size,omitempty"`
	Handoff *attach.Handoff   `json:"handoff,omitempty"`
	Error   *attach.WireError `json:"error,omitempty"`
}
