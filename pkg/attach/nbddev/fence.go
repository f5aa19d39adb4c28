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

package nbddev

import (
	"errors"
	"log/slog"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// superseded reports whether a reconnect failed because the server
// refused the export as superseded (nbd.ErrSuperseded): the grant the
// device was attached under was replaced (the volume was published to
// this node again since, or to another), and no connection of this
// device will be served again. Every other failure may pass.
func superseded(err error) bool { return errors.Is(err, nbd.ErrSuperseded) }

// fence ends a device whose export the server refused as superseded: it
// disconnects the device, which fails the I/O waiting with EIO, instead
// of reconnecting forever. Detach still succeeds afterwards.
func (a *Attacher) fence(v *volume, err error, log *slog.Logger) {
	v.mu.Lock()
	v.lastErr = err
	v.fenced = true
	v.mu.Unlock()
	log.Error("the server refused this volume's connection as superseded (the volume was published again since): the device is disconnected and its I/O fails", "error", err)
	if derr := a.cfg.Kernel.Disconnect(v.index); derr != nil {
		log.Warn("disconnecting the superseded device", "error", derr)
	}
}
