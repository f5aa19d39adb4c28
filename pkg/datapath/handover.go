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

package datapath

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/fdpass"
)

// The handover protocol, its commit point and who may serve a volume when,
// are in the package doc (# Handover).

// Handing is what a handover needs of the local data path;
// *attach.Manager is one.
type Handing interface {
	Volumes() map[string]attach.Transport
	HandOff(ctx context.Context, volumeID string) (*attach.Handoff, error)
	TakeHandoff(ctx context.Context, h *attach.Handoff) (*attach.Attachment, error)
}

var _ Handing = (*attach.Manager)(nil)

// HandoverPath is the handover socket of the service socket at path.
func HandoverPath(path string) string { return path + ".handover" }

// Bounds of a handover.
const (
	// quiesceTimeout bounds one volume's quiesce; a volume that does not
	// quiesce in time (its storage node away) stays with the old process.
	quiesceTimeout = 60 * time.Second
	// maxFiles bounds the files of a message (messages are bounded by
	// fdpass.MaxFrame).
	maxFiles = 16
)

// retryInterval is how long a successor waits before it asks again for
// the volumes that stayed with its predecessor.
var retryInterval = 2 * time.Second

// stepTimeout bounds the predecessor's wait for the successor's readiness
// (past it the predecessor says Resumed and serves on) and the writing of
// a message. The successor's wait for the release has no bound but its
// context and the predecessor's life.
var stepTimeout = 2 * time.Minute

// exitGrace bounds how long a successor that met the end of the exchange
// waits for the predecessor's pidfd to say it exited: a process closes its
// sockets a moment before it is seen to exit. A predecessor still running
// after it is alive, and its silence no release.
var exitGrace = 5 * time.Second

// releaseNotice is how often a successor waiting for a release says so.
var releaseNotice = 30 * time.Second

// handoverMsg is one message of the exchange.
type handoverMsg struct {
	Op       string          `json:"op,omitempty"` // "handover", from the successor
	Handoff  *attach.Handoff `json:"handoff,omitempty"`
	Files    int             `json:"files,omitempty"`
	Error    string          `json:"error,omitempty"`    // a volume that stays
	Ready    *bool           `json:"ready,omitempty"`    // the successor took the handoff
	Released bool            `json:"released,omitempty"` // the predecessor let it go
	// Resumed: the predecessor serves the volume again (no readiness in
	// time); the successor must not start it.
	Resumed bool `json:"resumed,omitempty"`
	Done    bool `json:"done,omitempty"` // no more volumes
	// Liveness, in the request: the successor can watch the predecessor's
	// exit; in the predecessor's first answer: its pidfd comes with it.
	Liveness bool `json:"liveness,omitempty"`
	// Generation is the successor's, in its request; Superseded the
	// answer to a successor older than the predecessor.
	Generation int64 `json:"generation,omitempty"`
	Superseded bool  `json:"superseded,omitempty"`
}

// ErrSuperseded: the running datapath is of a later generation than the
// one asking to take over: the asking one is the stale one, and must not
// serve.
var ErrSuperseded = errors.New("datapath: a datapath of a later generation serves the volumes")

// writeMsg sends m and files (fdpass.SendJSON: the length of the JSON,
// big-endian, then the JSON, the files with the length).
func writeMsg(c *net.UnixConn, m handoverMsg, files []*os.File) error {
	m.Files = len(files)
	return fdpass.SendJSON(c, m, files, time.Now().Add(stepTimeout))
}

// readMsg reads one message and the files that came with it, as many as
// it announces; a timeout of 0 waits for as long as it takes.
func readMsg(c *net.UnixConn, timeout time.Duration) (handoverMsg, []*os.File, error) {
	var m handoverMsg
	var deadline time.Time
	if timeout > 0 {
		deadline = time.Now().Add(timeout)
	} else if err := c.SetReadDeadline(time.Time{}); err != nil {
		return m, nil, err
	}
	files, err := fdpass.RecvJSON(c, &m, maxFiles, deadline)
	if err != nil {
		return m, nil, err
	}
	if m.Files != len(files) {
		fdpass.Close(files)
		return m, nil, fmt.Errorf("datapath: handover message announces %d files and carries %d", m.Files, len(files))
	}
	return m, files, nil
}

// handOver serves one successor on c: every volume of h, in turn.
// retire and unretire gate the service socket's calls.
func handOver(ctx context.Context, c *net.UnixConn, h Handing, gen int64, retire func(), unretire func(), log *slog.Logger) {
	defer c.Close()
	if err := checkRoot(c); err != nil {
		log.Warn("handover refused", "error", err)
		return
	}
	m, files, err := readMsg(c, stepTimeout)
	fdpass.Close(files)
	if err != nil || m.Op != "handover" {
		log.Warn("handover: bad request", "error", err, "op", m.Op)
		return
	}
	if gen > 0 && m.Generation > 0 && m.Generation < gen {
		log.Warn("a datapath of an older generation asks for the volumes: refused", "generation", gen, "asking", m.Generation)
		if err := writeMsg(c, handoverMsg{Superseded: true}, nil); err != nil {
			log.Warn("handover: refusal", "error", err)
		}
		return
	}
	if m.Liveness {
		// Its exit is how a successor tells our death from our silence.
		if pf, err := attach.SelfPidfd(); err != nil {
			log.Warn("handover: no pidfd for the successor: it will take our silence for life", "error", err)
		} else {
			err := writeMsg(c, handoverMsg{Liveness: true}, []*os.File{pf})
			pf.Close()
			if err != nil {
				log.Warn("handover: liveness", "error", err)
				return
			}
		}
	}
	retire()
	log.Info("a successor asks for the volumes: handing them over", "volumes", len(h.Volumes()))
	moved := 0
	for id := range h.Volumes() {
		if ctx.Err() != nil {
			break
		}
		ok, err := handOne(ctx, c, h, id, log)
		if err != nil {
			// The successor is gone (or broke the exchange): serve on.
			log.Error("handover interrupted; serving what is left", "volume_id", id, "error", err, "moved", moved)
			unretire()
			return
		}
		if ok {
			moved++
		}
	}
	if err := writeMsg(c, handoverMsg{Done: true}, nil); err != nil {
		log.Warn("handover: end", "error", err)
	}
	left := len(h.Volumes())
	log.Info("volumes handed to the successor", "moved", moved, "left", left)
	if left > 0 {
		// What did not move is still served here, calls included, until
		// the successor asks again (it does until nothing is left) or
		// this process ends.
		log.Warn("some volumes stayed with this process: serving them until the successor asks again", "left", left)
		unretire()
	}
}

// handOne moves one volume; ok reports whether it moved, err whether the
// exchange broke.
func handOne(ctx context.Context, c *net.UnixConn, h Handing, id string, log *slog.Logger) (ok bool, err error) {
	qctx, cancel := context.WithTimeout(ctx, quiesceTimeout)
	ho, herr := h.HandOff(qctx, id)
	cancel()
	if herr != nil {
		log.Warn("volume not handed over", "volume_id", id, "error", herr)
		return false, writeMsg(c, handoverMsg{Error: fmt.Sprintf("%s: %v", id, herr)}, nil)
	}
	// A volume not resumed stays quiesced: its I/O waits.
	resume := func() {
		if err := ho.Resume(); err != nil {
			log.Error("volume not resumed after its handover failed", "volume_id", id, "error", err)
		}
	}
	if err := writeMsg(c, handoverMsg{Handoff: ho}, ho.Files); err != nil {
		fdpass.Close(ho.Files)
		resume()
		return false, err
	}
	fdpass.Close(ho.Files)
	m, files, err := readMsg(c, stepTimeout)
	fdpass.Close(files)
	if err != nil || m.Ready == nil {
		// No readiness (in time): the volume is ours again. Said before it
		// is so, so that a successor still there never starts it: it
		// starts only on Released, or once this process has exited
		// without having said Resumed.
		if werr := writeMsg(c, handoverMsg{Resumed: true}, nil); werr != nil {
			log.Debug("handover: the successor did not hear that the volume stays", "volume_id", id, "error", werr)
		}
		resume()
		if err == nil {
			err = errors.New("datapath: handover: no readiness in the answer")
		}
		return false, err
	}
	if !*m.Ready {
		resume()
		log.Warn("the successor could not take the volume; serving it on", "volume_id", id, "error", m.Error)
		return false, nil
	}
	// The commit point: from here on the volume is never served here
	// again, whatever happens to the exchange.
	ho.Release()
	if err := writeMsg(c, handoverMsg{Released: true}, nil); err != nil {
		// The successor is gone (it reads until it hears a verdict).
		log.Warn("handover: released, but the successor did not hear it", "volume_id", id, "error", err)
		return true, err
	}
	log.Info("volume handed over", "volume_id", id)
	return true, nil
}

// TakeOver asks a predecessor serving the service socket at path for its
// volumes, and starts serving each on h. No predecessor is no error. It
// returns the volumes taken.
func TakeOver(ctx context.Context, path string, h Handing, log *slog.Logger) ([]*attach.Attachment, error) {
	return TakeOverGeneration(ctx, path, 0, h, log)
}

// TakeOverGeneration is TakeOver for a datapath of generation gen (see
// ServeGeneration); ErrSuperseded says the running one is newer.
//
// A volume the predecessor cannot hand over (it could not quiesce it: its
// storage node is away), or that h cannot take, stays with the
// predecessor, which serves it on; TakeOverGeneration asks again every
// retryInterval (after a broken exchange too) until no volume is left
// there, the predecessor is gone (what it served is then adopted, as
// after a crash) or ctx ends. It
// never returns while a live predecessor serves a volume, so that its
// caller, which adopts what it finds next, never serves a volume twice.
func TakeOverGeneration(ctx context.Context, path string, gen int64, h Handing, log *slog.Logger) ([]*attach.Attachment, error) {
	if log == nil {
		log = slog.Default()
	}
	var all []*attach.Attachment
	for round := 1; ; round++ {
		taken, left, err := takeOverRound(ctx, path, gen, h, log)
		all = append(all, taken...)
		switch {
		case errors.Is(err, ErrSuperseded):
			return all, err
		case err == nil && left == 0:
			return all, nil
		case err != nil:
			// The predecessor serves on what it did not hand over; if it
			// is gone, the next round finds nobody and returns.
			log.Warn("a handover round broke off; asking again", "error", err, "round", round, "taken", len(all))
		default:
			log.Warn("volumes stay with the running datapath; asking again (this one is not ready until they move or the other ends)",
				"left", left, "round", round, "taken", len(all))
		}
		select {
		case <-ctx.Done():
			return all, fmt.Errorf("datapath: volumes still with the predecessor: %w", ctx.Err())
		case <-time.After(retryInterval):
		}
	}
}

// takeOverRound is one exchange with the predecessor: what it took, and
// how many volumes stayed.
func takeOverRound(ctx context.Context, path string, gen int64, h Handing, log *slog.Logger) (taken []*attach.Attachment, left int, err error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	nc, err := d.DialContext(ctx, "unix", HandoverPath(path))
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ECONNREFUSED) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("datapath: reach the predecessor: %w", err)
	}
	c := nc.(*net.UnixConn)
	defer c.Close()
	if err := writeMsg(c, handoverMsg{Op: "handover", Generation: gen, Liveness: true}, nil); err != nil {
		return nil, 0, fmt.Errorf("datapath: handover request: %w", err)
	}
	log.Info("taking the volumes over from the running datapath")
	// The predecessor's pidfd: nil until it sends one (a predecessor of an
	// earlier release does not, and its end is then never taken for its
	// death).
	var pred *os.File
	defer func() {
		if pred != nil {
			pred.Close()
		}
	}()
	for {
		m, files, err := readMsg(c, quiesceTimeout+stepTimeout)
		if err != nil {
			return taken, 0, fmt.Errorf("datapath: handover: %w", err)
		}
		switch {
		case m.Liveness:
			if len(files) == 1 && pred == nil {
				pred = files[0]
			} else {
				fdpass.Close(files)
			}
			continue
		case m.Superseded:
			fdpass.Close(files)
			return nil, 0, ErrSuperseded
		case m.Done:
			fdpass.Close(files)
			log.Info("handover round complete", "taken", len(taken), "left", left)
			return taken, left, nil
		case m.Error != "":
			fdpass.Close(files)
			log.Warn("a volume stays with the predecessor", "error", m.Error)
			left++
			continue
		case m.Handoff == nil:
			fdpass.Close(files)
			return taken, 0, errors.New("datapath: handover: a message with neither volume nor end")
		}
		ho := m.Handoff
		ho.Files = files
		att, err := h.TakeHandoff(ctx, ho)
		if err != nil {
			log.Error("cannot take a volume over; the predecessor serves it on", "volume_id", ho.VolumeID, "error", err)
			no := false
			if werr := writeMsg(c, handoverMsg{Ready: &no, Error: err.Error()}, nil); werr != nil {
				return taken, 0, werr
			}
			left++
			continue
		}
		yes := true
		if err := writeMsg(c, handoverMsg{Ready: &yes}, nil); err != nil {
			// Not heard: the predecessor resumes (or is gone: then the next
			// round finds nobody, and what it served is adopted).
			ho.Abort()
			return taken, 0, fmt.Errorf("datapath: handover: %w", err)
		}
		start, why := awaitRelease(ctx, c, pred, ho.VolumeID, log)
		if !start {
			ho.Abort()
			log.Warn("a volume taken is not started: its predecessor did not release it", "volume_id", ho.VolumeID, "why", why)
			return taken, 0, fmt.Errorf("datapath: handover of %s: %s", ho.VolumeID, why)
		}
		if err := ho.Start(); err != nil {
			log.Error("a volume taken over did not start; it is taken over again by the next attach", "volume_id", ho.VolumeID, "error", err)
		} else {
			taken = append(taken, att)
		}
		if why != "" {
			return taken, 0, fmt.Errorf("datapath: handover: %s", why)
		}
	}
}

// awaitRelease waits, after the successor's readiness, for the
// predecessor's verdict on the volume: start reports whether the
// successor may serve it, which it may only once the predecessor has said
// Released, or has exited (its pidfd pred says so) without having said
// Resumed. A silence, a timeout or the end of the connection from a
// predecessor that still runs is no release: it may be slow to let go,
// and serving beside it would give the device two servers. why, if not
// empty, says why the exchange ends.
func awaitRelease(ctx context.Context, c *net.UnixConn, pred *os.File, id string, log *slog.Logger) (start bool, why string) {
	type verdict struct {
		m   handoverMsg
		err error
	}
	vc := make(chan verdict, 1)
	// No deadline: only a verdict, the predecessor's end or ours ends the
	// wait.
	go func() {
		m, files, err := readMsg(c, 0)
		fdpass.Close(files)
		vc <- verdict{m, err}
	}()
	began := time.Now()
	tick := time.NewTicker(releaseNotice)
	defer tick.Stop()
	for {
		select {
		case v := <-vc:
			switch {
			case v.err == nil && v.m.Released:
				return true, ""
			case v.err == nil && v.m.Resumed:
				return false, "the predecessor serves it on (it did not hear the readiness in time)"
			case v.err == nil:
				return false, "the predecessor answered the readiness with neither release nor resume"
			}
			if attach.PidfdExitedBy(pred, time.Now().Add(exitGrace)) {
				log.Warn("the predecessor exited during the handover, without resuming the volume: starting it", "volume_id", id, "error", v.err)
				return true, fmt.Sprintf("the predecessor exited (%v)", v.err)
			}
			return false, fmt.Sprintf("the exchange ended and the predecessor is not seen to have exited: %v", v.err)
		case <-tick.C:
			log.Warn("waiting for the predecessor to release a volume (it runs, and no silence of it counts as a release)", "volume_id", id, "waited", time.Since(began).Round(time.Second))
		case <-ctx.Done():
			c.SetReadDeadline(pastDeadline)
			if v := <-vc; v.err == nil && v.m.Released {
				return true, ""
			}
			return false, ctx.Err().Error()
		}
	}
}

// pastDeadline ends a pending read at once.
var pastDeadline = time.Unix(1, 0)
