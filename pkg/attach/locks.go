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

package attach

import "sync"

// VolumeLocks serializes what is done to one volume while other volumes
// go on: a lock per volume ID, kept only while someone holds or waits for
// it. The zero value is ready to use.
type VolumeLocks struct {
	mu sync.Mutex
	m  map[string]*volumeLock
}

type volumeLock struct {
	mu   sync.Mutex
	refs int
}

// Lock takes the volume's lock and returns its unlock.
func (ls *VolumeLocks) Lock(id string) (unlock func()) {
	ls.mu.Lock()
	if ls.m == nil {
		ls.m = map[string]*volumeLock{}
	}
	l := ls.m[id]
	if l == nil {
		l = &volumeLock{}
		ls.m[id] = l
	}
	l.refs++
	ls.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		ls.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(ls.m, id)
		}
		ls.mu.Unlock()
	}
}
