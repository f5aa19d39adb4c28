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
	"context"
	"crypto/tls"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// benchmarkLoopback measures the server and client together over TCP on
// loopback (with STARTTLS when withTLS), qd requests of bs bytes in flight.
func benchmarkLoopback(b *testing.B, write bool, bs, qd int, withTLS bool) {
	const size = 256 << 20
	s := &Server{Logger: quietLogger()}
	var clientTLS *tls.Config
	if withTLS {
		p := newTestPKI(b)
		s.TLSConfig, clientTLS = p.server, p.client
	}
	if err := s.AddExport(&Export{Name: "d", Backend: NewMemBackend(size)}); err != nil {
		b.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go s.Serve(l)
	defer s.Shutdown(context.Background())
	cl, err := Dial(context.Background(), DialOptions{Addr: l.Addr().String(), Export: "d", TLS: clientTLS})
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	b.SetBytes(int64(bs))
	b.ResetTimer()
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < qd; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, bs)
			for {
				i := next.Add(1) - 1
				if i >= int64(b.N) {
					return
				}
				off := (i * int64(bs)) % (size - int64(bs))
				off -= off % int64(bs)
				var err error
				if write {
					_, err = cl.WriteAt(buf, off)
				} else {
					_, err = cl.ReadAt(buf, off)
				}
				if err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}

func BenchmarkLoopbackRead1M(b *testing.B)     { benchmarkLoopback(b, false, 1<<20, 8, false) }
func BenchmarkLoopbackWrite1M(b *testing.B)    { benchmarkLoopback(b, true, 1<<20, 8, false) }
func BenchmarkLoopbackRead4K(b *testing.B)     { benchmarkLoopback(b, false, 4096, 32, false) }
func BenchmarkLoopbackWrite4K(b *testing.B)    { benchmarkLoopback(b, true, 4096, 32, false) }
func BenchmarkLoopbackTLSRead1M(b *testing.B)  { benchmarkLoopback(b, false, 1<<20, 8, true) }
func BenchmarkLoopbackTLSWrite1M(b *testing.B) { benchmarkLoopback(b, true, 1<<20, 8, true) }
