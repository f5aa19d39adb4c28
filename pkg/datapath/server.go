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
	"net/rpc"
	"net/rpc/jsonrpc"
	"os"
	"path/filepath"
	"sync"
)

// rpcService adapts a Service to net/rpc's method shape.
type rpcService struct {
	svc  Service
	ctx  context.Context
	gate gate
}

// gate lets calls through until a successor takes the volumes over; the
// takeover waits for the calls in flight.
type gate struct {
	mu      sync.RWMutex
	retired bool
}

var errRetired = errors.New("datapath: handing the volumes to a successor")

func (g *gate) enter() (func(), error) {
	g.mu.RLock()
	if g.retired {
		g.mu.RUnlock()
		return nil, errRetired
	}
	return g.mu.RUnlock, nil
}

func (g *gate) retire() {
	g.mu.Lock()
	g.retired = true
	g.mu.Unlock()
}

func (g *gate) unretire() {
	g.mu.Lock()
	g.retired = false
	g.mu.Unlock()
}

func (s *rpcService) Attach(a AttachArgs, r *AttachReply) error {
	leave, err := s.gate.enter()
	if err != nil {
		return err
	}
	defer leave()
	att, err := s.svc.Attach(s.ctx, a.Transport, a.Target, a.Options)
	r.Attachment, r.Err = att, toWire(err)
	return nil
}

func (s *rpcService) Detach(a VolumeArgs, r *ErrReply) error {
	leave, err := s.gate.enter()
	if err != nil {
		return err
	}
	defer leave()
	r.Err = toWire(s.svc.Detach(s.ctx, a.VolumeID))
	return nil
}

func (s *rpcService) Health(a VolumeArgs, r *HealthReply) error {
	leave, err := s.gate.enter()
	if err != nil {
		return err
	}
	defer leave()
	tr, h, err := s.svc.Health(a.VolumeID)
	r.Transport, r.Health, r.Err = tr, h, toWire(err)
	return nil
}

func (s *rpcService) Resize(a ResizeArgs, r *ResizeReply) error {
	leave, err := s.gate.enter()
	if err != nil {
		return err
	}
	defer leave()
	n, err := s.svc.Resize(s.ctx, a.VolumeID, a.NewSize)
	r.Size, r.Err = n, toWire(err)
	return nil
}

func (s *rpcService) Volumes(_ None, r *VolumesReply) error {
	leave, err := s.gate.enter()
	if err != nil {
		return err
	}
	defer leave()
	r.Volumes = s.svc.Volumes()
	return nil
}

func (s *rpcService) Adopt(_ None, r *AdoptReply) error {
	leave, err := s.gate.enter()
	if err != nil {
		return err
	}
	defer leave()
	atts, err := s.svc.Adopt(s.ctx)
	r.Attachments, r.Err = atts, toWire(err)
	return nil
}

func (s *rpcService) Available(_ None, r *AvailableReply) error {
	leave, err := s.gate.enter()
	if err != nil {
		return err
	}
	defer leave()
	r.Transports = s.svc.Available()
	return nil
}

// Serve serves svc on the unix socket at path (replacing a stale one,
// readable by root only) until ctx ends. Calls run with ctx: a call in
// flight when it ends is cancelled.
func Serve(ctx context.Context, path string, svc Service, log *slog.Logger) error {
	return ServeGeneration(ctx, path, svc, log, 0, nil)
}

// ServeGeneration is Serve for a datapath of generation gen (its pod
// template's, counting up with every change; 0 is unknown): it hands its
// volumes over to a successor of a later (or unknown) generation only,
// so that a datapath of an old pod, restarted after it handed its
// volumes on, cannot take them back. ready, if not nil, is called once
// the sockets accept connections (a readiness signal given before would
// let a caller meet a socket that refuses); its error stops serving.
func ServeGeneration(ctx context.Context, path string, svc Service, log *slog.Logger, gen int64, ready func() error) error {
	if log == nil {
		log = slog.Default()
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("datapath: %w", err)
	}
	l, err := listenPrivate(path)
	if err != nil {
		return err
	}
	rs := &rpcService{svc: svc, ctx: ctx}
	srv := rpc.NewServer()
	if err := srv.RegisterName(serviceName, rs); err != nil {
		l.Close()
		return err
	}
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	if h, ok := svc.(Handing); ok {
		hl, err := listenPrivate(HandoverPath(path))
		if err != nil {
			l.Close()
			return err
		}
		stopH := context.AfterFunc(ctx, func() { hl.Close() })
		// Before wg.Wait: the loop below ends once the listener closes.
		defer func() {
			stopH()
			hl.Close()
		}()
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := hl.Accept()
				if err != nil {
					return
				}
				// One successor at a time: the volumes go to the first.
				handOver(ctx, c.(*net.UnixConn), h, gen, rs.gate.retire, rs.gate.unretire, log)
			}
		}()
	}
	if ready != nil {
		if err := ready(); err != nil {
			l.Close()
			return err
		}
	}
	log.Info("datapath serving", "socket", path)
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("datapath: accept: %w", err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			srv.ServeCodec(jsonrpc.NewServerCodec(c))
		}()
	}
}

const serviceName = "Datapath"

// listenPrivate listens on the unix socket at path, replacing a stale
// one (or the socket of a predecessor, which keeps the connections it
// has), readable by root only.
func listenPrivate(path string) (*net.UnixListener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("datapath: stale socket: %w", err)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("datapath: %w", err)
	}
	// The predecessor's socket file is ours to replace, not to delete
	// when this listener closes.
	l.SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("datapath: %w", err)
	}
	return l, nil
}
