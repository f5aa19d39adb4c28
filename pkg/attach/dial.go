package attach

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// minAddrTimeout is the least time one address gets before the next is
// tried: a path whose NIC is down answers nothing, and waiting the whole
// dial timeout on it would keep a volume from the paths that work.
const minAddrTimeout = 2 * time.Second

// AddrDialer dials a volume's server addresses in turn, starting with the
// one that worked last, so that a volume attaches and reconnects as long
// as any of its storage paths works. It is safe for concurrent use.
type AddrDialer struct {
	mu   sync.Mutex
	next int
}

// DialFunc dials and negotiates one address.
type DialFunc[T any] func(ctx context.Context, addr string) (T, error)

// Dial tries each of addrs once, from the last good one on, giving each a
// share of ctx's time (at least minAddrTimeout) and returns the first
// success. A refusal by the server (ErrServerRefused) ends the round at
// once: the other addresses reach the same server.
func Dial[T any](ctx context.Context, d *AddrDialer, addrs []string, dial DialFunc[T]) (T, string, error) {
	var zero T
	if len(addrs) == 0 {
		return zero, "", fmt.Errorf("%w: no server address", ErrInvalid)
	}
	d.mu.Lock()
	start := d.next % len(addrs)
	d.mu.Unlock()
	var errs []error
	for i := range addrs {
		k := (start + i) % len(addrs)
		actx, cancel := ctx, context.CancelFunc(func() {})
		if i < len(addrs)-1 {
			share := minAddrTimeout
			if dl, ok := ctx.Deadline(); ok {
				share = max(time.Until(dl)/time.Duration(len(addrs)-i), minAddrTimeout)
			}
			actx, cancel = context.WithTimeout(ctx, share)
		}
		v, err := dial(actx, addrs[k])
		cancel()
		if err == nil {
			d.mu.Lock()
			d.next = k
			d.mu.Unlock()
			return v, addrs[k], nil
		}
		errs = append(errs, err)
		if errors.Is(err, ErrServerRefused) || ctx.Err() != nil {
			break
		}
	}
	return zero, "", errors.Join(errs...)
}
