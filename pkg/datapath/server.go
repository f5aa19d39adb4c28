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
	svc Service
	ctx context.Context
}

func (s *rpcService) Attach(a AttachArgs, r *AttachReply) error {
	att, err := s.svc.Attach(s.ctx, a.Transport, a.Target, a.Options)
	r.Attachment, r.Err = att, toWire(err)
	return nil
}

func (s *rpcService) Detach(a VolumeArgs, r *ErrReply) error {
	r.Err = toWire(s.svc.Detach(s.ctx, a.VolumeID))
	return nil
}

func (s *rpcService) Health(a VolumeArgs, r *HealthReply) error {
	tr, h, err := s.svc.Health(a.VolumeID)
	r.Transport, r.Health, r.Err = tr, h, toWire(err)
	return nil
}

func (s *rpcService) Resize(a ResizeArgs, r *ResizeReply) error {
	n, err := s.svc.Resize(s.ctx, a.VolumeID, a.NewSize)
	r.Size, r.Err = n, toWire(err)
	return nil
}

func (s *rpcService) Volumes(_ None, r *VolumesReply) error {
	r.Volumes = s.svc.Volumes()
	return nil
}

func (s *rpcService) Adopt(_ None, r *AdoptReply) error {
	atts, err := s.svc.Adopt(s.ctx)
	r.Attachments, r.Err = atts, toWire(err)
	return nil
}

func (s *rpcService) Available(_ None, r *AvailableReply) error {
	r.Transports = s.svc.Available()
	return nil
}

// Serve serves svc on the unix socket at path (replacing a stale one,
// readable by root only) until ctx ends. Calls run with ctx: a call in
// flight when it ends is cancelled.
func Serve(ctx context.Context, path string, svc Service, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("datapath: %w", err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("datapath: stale socket: %w", err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("datapath: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return fmt.Errorf("datapath: %w", err)
	}
	srv := rpc.NewServer()
	if err := srv.RegisterName(serviceName, &rpcService{svc: svc, ctx: ctx}); err != nil {
		l.Close()
		return err
	}
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
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
