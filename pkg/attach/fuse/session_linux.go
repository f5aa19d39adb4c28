package fuse

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// dialTimeout bounds one dial + handshake round over the addresses.
const dialTimeout = 10 * time.Second

// dataPath is a volume's NBD session: a relay without a local connection
// (in-process calls), which dials the storage addresses in turn, redials
// while the volume is attached, replays what was unanswered and keeps what
// no FLUSH covers yet. The FUSE file's I/O goes through client.
type dataPath struct {
	relay     *relay.Relay
	client    *nbd.Client
	info      nbd.ExportInfo
	multipath bool
	addrs     attach.AddrDialer
	stop      context.CancelFunc
	done      chan struct{}
}

// openDataPath connects the volume's first connection (ctx bounds it) and
// starts the session.
func openDataPath(ctx context.Context, cfg Config, t attach.Target, o attach.Options, log *slog.Logger) (*dataPath, error) {
	dp := &dataPath{done: make(chan struct{})}
	id := nbd.NewSessionID()
	x := attach.ExportDialer{DialContext: cfg.DialContext, Logger: log}
	dial := func(ctx context.Context) (*relay.Remote, error) {
		ctx, cancel := context.WithTimeout(ctx, dialTimeout)
		defer cancel()
		rc, _, err := attach.Dial(ctx, &dp.addrs, t.Addrs, func(ctx context.Context, addr string) (*relay.Remote, error) {
			c, info, err := x.DialExport(ctx, addr, "", t.Export, true, &nbd.Session{ID: id, Generation: nbd.NextGeneration()})
			if err != nil {
				return nil, err
			}
			return &relay.Remote{Conn: c, Info: info}, nil
		})
		return rc, err
	}
	first, err := dial(ctx)
	if err != nil {
		return nil, err
	}
	dp.info = first.Info
	dp.multipath = nbd.IsMultipathTCP(first.Conn)
	ro := relay.Options{Logger: log}
	if d := o.DeadConnTimeout; d > 0 && d < attach.DefaultDeadConnTimeout {
		ro.FailAfter = d
	}
	dp.relay = relay.New(nil, first, func(ctx context.Context) (net.Conn, error) {
		rc, err := dial(ctx)
		if err != nil {
			return nil, err
		}
		return rc, nil
	}, ro)
	rctx, stop := context.WithCancel(context.Background())
	dp.stop = stop
	go func() {
		defer close(dp.done)
		if err := dp.relay.Run(rctx); err != nil && !errors.Is(err, context.Canceled) {
			log.Error("fuse: NBD session ended: I/O fails", "err", err)
		}
	}()
	dp.client = nbd.NewClientOn(dp.info, dp.relay, log)
	return dp, nil
}

// flush is a FLUSH bounded by timeout: with the server away it would
// wait for it, and a detach must not.
func (dp *dataPath) flush(timeout time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- dp.client.Flush() }()
	select {
	case err := <-done:
		return err
	case <-time.After(timeout):
		return fmt.Errorf("no answer from the storage node within %v", timeout)
	}
}

// close ends the session (NBD_CMD_DISC once the requests in flight are
// answered, if the server answers within timeout) and waits for it.
func (dp *dataPath) close(timeout time.Duration) {
	closed := make(chan struct{})
	go func() {
		dp.client.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(timeout):
	}
	dp.stop()
	<-dp.done
}

// probeSize asks the server for the export's size on a connection of its
// own (no session: it must not supersede the data connection).
func probeSize(ctx context.Context, cfg Config, t attach.Target, addrs *attach.AddrDialer) (uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, dialTimeout)
	defer cancel()
	x := attach.ExportDialer{DialContext: cfg.DialContext}
	info, _, err := attach.Dial(ctx, addrs, t.Addrs, func(ctx context.Context, addr string) (nbd.ExportInfo, error) {
		c, info, err := x.DialExport(ctx, addr, "", t.Export, true, nil)
		if err != nil {
			return nbd.ExportInfo{}, err
		}
		nbd.NewClient(info, []net.Conn{c}, nil).Close()
		return info, nil
	})
	return info.Size, err
}
