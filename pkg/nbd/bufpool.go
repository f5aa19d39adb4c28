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

package nbd

import (
	"math/bits"
	"sync"
)

// Buffers for request and reply payloads come from power-of-two size
// classes between 4 KiB and MaxRequestSize, so a steady stream of requests
// allocates nothing.
const (
	minPoolShift = 12
	maxPoolShift = 25 // 32 MiB
)

var bufPools [maxPoolShift - minPoolShift + 1]sync.Pool

func poolIndex(n int) int {
	if n <= 1<<minPoolShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minPoolShift
}

// getBuf returns a buffer of length n (n <= MaxRequestSize).
func getBuf(n int) []byte {
	if n == 0 {
		return nil
	}
	i := poolIndex(n)
	if p, ok := bufPools[i].Get().(*[]byte); ok {
		return (*p)[:n]
	}
	return make([]byte, n, 1<<(i+minPoolShift))
}

// putBuf returns a buffer obtained from getBuf.
func putBuf(b []byte) {
	c := cap(b)
	if c < 1<<minPoolShift || c&(c-1) != 0 || c > 1<<maxPoolShift {
		return
	}
	b = b[:c]
	bufPools[poolIndex(c)].Put(&b)
}
