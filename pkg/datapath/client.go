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
	"fmt"
	"net"
	"net/rpc"
	"net/rpc/jsonrpc"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// Client drives a datapath component over its unix socket. Every call
// dials afresh, so a restarted component is found again.
type Client struct {
	Path string
	// DialTimeout bounds reaching the socket (default 5s).
	DialTimeout time.Duration
}

var _ Service = (*Client)(nil)

// call runs one method; ctx cancels it (the connection closes, and the
// component carries on with what it was doing).
func (c *Client) call(ctx context.Context, method string, args, reply any) error {
	d := c.DialTimeout
	if d <= 0 {
		d = 5 * time.Second
	}
	dctx, cancel := context.WithTimeout(ctx, d)
	conn, err := (&net.Dialer{}).DialContext(dctx, "unix", c.Path)
	cancel()
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrUnavailable, c.Path, err)
	}
	cl := rpc.NewClientWithCodec(jsonrpc.NewClientCodec(conn))
	defer cl.Close()
	done := cl.Go(serviceName+"."+method, args, reply, make(chan *rpc.Call, 1)).Done
	select {
	case call := <-done:
		if call.Error != nil {
			return fmt.Errorf("%w: %s: %v", ErrUnavailable, method, call.Error)
		}
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Attach attaches a volume in the component.
func (c *Client) Attach(ctx context.Context, tr attach.Transport, t attach.Target, o attach.Options) (*attach.Attachment, error) {
	var r AttachReply
	if err := c.call(ctx, "Attach", AttachArgs{tr, t, o}, &r); err != nil {
		return nil, err
	}
	if r.Err != nil {
		return nil, r.Err.err()
	}
	return r.Attachment, nil
}

// Detach detaches a volume in the component.
func (c *Client) Detach(ctx context.Context, volumeID string) error {
	var r ErrReply
	if err := c.call(ctx, "Detach", VolumeArgs{volumeID}, &r); err != nil {
		return err
	}
	return r.Err.err()
}

// Health reports a volume's data path.
func (c *Client) Health(volumeID string) (attach.Transport, attach.Health, error) {
	var r HealthReply
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.call(ctx, "Health", VolumeArgs{volumeID}, &r); err != nil {
		return "", attach.Health{}, err
	}
	return r.Transport, r.Health, r.Err.err()
}

// Resize grows a volume's device.
func (c *Client) Resize(ctx context.Context, volumeID string, newSize uint64) (uint64, error) {
	var r ResizeReply
	if err := c.call(ctx, "Resize", ResizeArgs{volumeID, newSize}, &r); err != nil {
		return 0, err
	}
	return r.Size, r.Err.err()
}

// Volumes lists the volumes the component serves (none when it does not
// answer).
func (c *Client) Volumes() map[string]attach.Transport {
	var r VolumesReply
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if c.call(ctx, "Volumes", None{}, &r) != nil {
		return nil
	}
	return r.Volumes
}

// Adopt asks the component to take over what an earlier one of it left.
func (c *Client) Adopt(ctx context.Context) ([]*attach.Attachment, error) {
	var r AdoptReply
	if err := c.call(ctx, "Adopt", None{}, &r); err != nil {
		return nil, err
	}
	return r.Attachments, r.Err.err()
}

// Available lists the component's transports (none when it does not
// answer).
func (c *Client) Available() []attach.Transport {
	var r AvailableReply
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if c.call(ctx, "Available", None{}, &r) != nil {
		return nil
	}
	return r.Transports
}
