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

package driver

import (
	"sync"
)

// Changes tells the controller's waits that an object they wait for
// changed, so that a wait reads the object again at once instead of
// polling it. A watch of NBDVolumes and NBDSnapshots (an informer) calls
// Notify for every event; a wait subscribes to its object's key before
// its first read, so no change between that read and the wait is missed.
// The zero value is not usable: use NewChanges.
type Changes struct {
	mu   sync.Mutex
	subs map[string]map[chan struct{}]struct{}
}

// NewChanges returns an empty Changes.
func NewChanges() *Changes {
	return &Changes{subs: map[string]map[chan struct{}]struct{}{}}
}

// VolumeKey and SnapshotKey are the keys of an NBDVolume and of an
// NBDSnapshot.
func VolumeKey(name string) string   { return "nbdvolume/" + name }
func SnapshotKey(name string) string { return "nbdsnapshot/" + name }

// Subscribe returns a channel that receives after each Notify of key (one
// pending receive at most: changes in a burst collapse into one), and the
// function that ends the subscription.
func (c *Changes) Subscribe(key string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	c.mu.Lock()
	if c.subs[key] == nil {
		c.subs[key] = map[chan struct{}]struct{}{}
	}
	c.subs[key][ch] = struct{}{}
	c.mu.Unlock()
	return ch, func() {
		c.mu.Lock()
		delete(c.subs[key], ch)
		if len(c.subs[key]) == 0 {
			delete(c.subs, key)
		}
		c.mu.Unlock()
	}
}

// Notify wakes every subscriber of key; it never blocks.
func (c *Changes) Notify(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for ch := range c.subs[key] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// subscribers counts the subscriptions of key (for tests).
func (c *Changes) subscribers(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.subs[key])
}
