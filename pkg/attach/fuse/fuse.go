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

// Package fuse is the attach transport for nodes without an nbd driver:
// the volume's NBD session (attach.Session: MPTCP, redial, replay) serves
// the export as a single file in a FUSE file system, and a loop device on
// that file is the block device.
//
// For volume V the file system is mounted at <StateDir>/V and holds one
// regular file, <StateDir>/V/V, of the export's size. Reads and writes of
// the file become NBD reads and writes, fsync becomes NBD_CMD_FLUSH, and
// fallocate becomes NBD_CMD_WRITE_ZEROES (punch hole and zero range; the
// loop driver turns discards and write-zeroes requests into those). The
// loop device accesses the file with direct I/O, so neither the loop
// device's data nor the file's is cached twice.
//
// # The FUSE server
//
// The file system is served by a small FUSE protocol server of this
// package (proto_linux.go, server_linux.go), mounted with mount(2). It
// keeps no per-node or per-open state: the root is node 1, the file node
// 2, file handles are 0. Whoever holds the /dev/fuse descriptor and the
// parameters INIT negotiated can therefore answer every request, which is
// what lets a volume move to another process. Several readers each take
// one request per read(2) and answer it with one write before the next;
// the descriptor is non-blocking and in the runtime's poller, so the
// readers can be stopped at a request boundary with nothing taken and
// unanswered. The kernel may keep up to Config.MaxBackground asynchronous
// requests in flight (the loop driver's direct I/O), each of at most
// Config.MaxWrite bytes.
//
// # One server process per volume
//
// The FUSE file system of a volume is served by a process of its own, not
// by the process that calls Attach (the node plugin). Attach starts it
// (Config.ServeCommand, by default the running executable again, which
// must hand over to ServeMain when ServeRequested says so) in a session of
// its own, so it neither dies with the plugin nor gets the signals of the
// plugin's process group; once the plugin is gone, whatever reaps orphans
// in its PID namespace (PID 1, a subreaper) reaps it. The server dials the
// export, mounts the file system, attaches the loop device and then
// answers on a unix socket, <StateDir>/V.sock (mode 0600): status, health,
// resize, detach and handoff. It holds the lock <StateDir>/V.lock for as
// long as it lives and describes itself in <StateDir>/V.json. Detach asks
// it to remove the loop device, unmount, disconnect (NBD_CMD_DISC) and
// exit, and returns once it has. A server costs about 10 MiB of memory
// besides the requests in flight (see DefaultMaxBackground), charged to
// the plugin's cgroup.
//
// An Attacher keeps no state that matters: a new one, in a new process,
// finds the servers through the state directory and adopts them. Attach
// of a volume that is being served returns the existing attachment, and
// Health, Resize and Detach go through the socket. What a dead server
// left behind (a loop device on its file, the mount, the socket and state
// files) is cleaned up by the next Attach or Detach of the volume; Attach
// then starts a new server.
//
// # Handing a volume over
//
// The Attacher implements attach.HandingOver, so that a planned upgrade
// replaces a volume's server process while the loop device, the file
// system on it and the I/O to it go on. HandOff asks the server, on its
// socket, to quiesce: its readers stop, every request they took is
// answered, and the session is flushed, so that no acknowledged write
// lives only in that process. It answers with the handoff's state (the
// INIT parameters, the file's attributes, the NBD session's ID, the
// device) and, over SCM_RIGHTS, two files: the /dev/fuse descriptor and
// the volume's lock file, whose flock belongs to the open file and so passes to
// the successor without a moment in which no process holds it. Meanwhile
// the kernel queues the device's requests. TakeHandoff starts a successor
// server process with both files (descriptors 4 and 5) and the state; it
// dials the export on the predecessor's session (a later generation: from
// its first request on the storage node fences the predecessor's
// connection) but reads nothing from the kernel.
// Release tells the predecessor to close its connection and exit without
// unmounting or detaching anything; Start then tells the successor to
// read /dev/fuse, listen on V.sock and write V.json. If the successor
// fails before it is ready (or its Attacher calls Abort), Resume lets the
// predecessor serve again; so does a predecessor that hears neither within
// two minutes, or whose HandOff connection breaks.
//
// This survives restarts of the plugin process, as long as the server
// processes live on: I/O to the devices continues while no plugin runs.
// It does not survive the death of a volume's server process: the FUSE
// connection goes with it and I/O to the device fails until the volume is
// detached and attached again. Nor does it survive a restart of the
// container the plugin runs in, when the runtime kills every process of
// the container's cgroup (or the plugin is the PID 1 of a PID namespace,
// whose exit kills the namespace): the servers go too, unless they were
// handed over to a process outside it first. Where that matters, use the
// relay transport on a kernel with nbd, whose devices a fresh process
// re-adopts with nothing running in between.
//
// While the storage node is unreachable the session redials and replays
// what was unanswered (attach.Options.DeadConnTimeout can bound the
// outage, after which I/O fails with EIO); Health reports the outage and
// the reconnects.
package fuse

import (
	"log/slog"
	"os"
	"time"
)

// DefaultStateDir is where volumes are mounted unless Config.StateDir says
// otherwise.
const DefaultStateDir = "/run/mpnbd/fuse"

// Defaults of the FUSE and loop settings; see Config.
const (
	// DefaultMaxWrite is the largest FUSE read or write request: 1 MiB,
	// the kernel's limit with the default fs.fuse.max_pages_limit.
	DefaultMaxWrite = 1 << 20
	// DefaultMaxBackground bounds the asynchronous requests the kernel
	// keeps in flight to the FUSE server; the loop driver's direct I/O is
	// asynchronous, so this is the device's effective queue depth. Each
	// request in flight holds a MaxWrite buffer in the server: 32 MiB at
	// most per volume. 12, 32 and 128 moved data equally fast.
	DefaultMaxBackground = 32
)

// ServeEnv is the environment variable that tells a process started by
// an Attacher to be a volume's server: ServeRequested reports it.
const ServeEnv = "MPNBD_FUSE_SERVE"

// ServeArg is the argument the default ServeCommand passes after the
// running executable, so that server processes stand out in ps.
const ServeArg = "fuse-serve"

// Config configures an Attacher. Zero values mean the defaults.
type Config struct {
	// StateDir holds, per attached volume, the mount point and the
	// server's socket, lock and state files (DefaultStateDir if empty).
	// It is created, mode 0700, when missing. Every Attacher of the node
	// must use the same one.
	StateDir string
	// ServeCommand starts a volume's server process: the program and its
	// arguments. It runs with ServeEnv=1 added to the environment, the
	// attach request on standard input and two more descriptors (3 and 4;
	// a successor taking a handoff a third, 5) that ServeMain uses, and
	// must end in a call of ServeMain, like a main that starts with
	//
	//	if fuse.ServeRequested() {
	//		os.Exit(fuse.ServeMain())
	//	}
	//
	// Empty means the running executable (os.Executable) with ServeArg.
	// A wrapper that execs the program keeps the descriptors (nsenter
	// --net=PATH, to dial from another network namespace).
	ServeCommand []string

	// Logger receives warnings and events; nil means slog.Default(). The
	// server processes log to the attaching process's standard error.
	Logger *slog.Logger

	// MaxWrite is the largest FUSE read/write request
	// (DefaultMaxWrite if zero).
	MaxWrite int
	// MaxBackground bounds the kernel's asynchronous FUSE requests
	// (DefaultMaxBackground if zero).
	MaxBackground int

	// UnmountTimeout bounds the wait at detach for the loop device to be
	// released (by a file system unmounted just before) and for the mount
	// to let go of the file (5 s if zero). A detach through a server
	// process uses the detaching Attacher's value.
	UnmountTimeout time.Duration

	// For measurements only: the loop device without direct I/O, the
	// FUSE file with a page cache, no asynchronous direct I/O.
	bufferedLoop, cachedFile, syncDIO bool
}

// ServeRequested reports whether this process was started as a volume's
// server (ServeEnv is set), in which case main should exit with the
// result of ServeMain before doing anything else.
func ServeRequested() bool { return os.Getenv(ServeEnv) == "1" }

func (c Config) withDefaults() Config {
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MaxWrite <= 0 {
		c.MaxWrite = DefaultMaxWrite
	}
	if c.MaxBackground <= 0 {
		c.MaxBackground = DefaultMaxBackground
	}
	if c.UnmountTimeout <= 0 {
		c.UnmountTimeout = 5 * time.Second
	}
	return c
}
