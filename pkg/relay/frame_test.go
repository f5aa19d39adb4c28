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

package relay

import (
	"bytes"
	"net"
	"strings"
	"testing"
)

// An entry is recycled exactly when the reply path and every writer are
// done with it, whatever the order.
func TestEntryRecycledByLastUser(t *testing.T) {
	for _, seq := range []string{
		"a",     // answered, never being written
		"s t a", // written, then answered
		"s a t", // answered while being written
		"s s t t a",
		"s s t a t", // a stale writer and the replay overlap
		"s s a t t",
	} {
		e := &entry{handle: 1, buf: getBuf(4096)}
		e.payload = *e.buf
		ops := strings.Fields(seq)
		for i, op := range ops {
			switch op {
			case "s":
				sending(e)
			case "t":
				sent(e)
			case "a":
				answered(e)
			}
			recycled := e.handle == 0 && e.buf == nil
			if last := i == len(ops)-1; recycled != last {
				t.Fatalf("%q: after op %d recycled=%v", seq, i, recycled)
			}
		}
	}
}

type recordConn struct {
	net.Conn
	writes [][]byte
}

func (c *recordConn) Write(p []byte) (int, error) {
	c.writes = append(c.writes, append([]byte(nil), p...))
	return len(p), nil
}

// Small frames are gathered, big ones go out at once behind them, and the
// byte stream keeps the frames' order.
func TestFrameWriterOrder(t *testing.T) {
	c := &recordConn{}
	var w frameWriter
	w.reset(c)
	var want []byte
	frame := func(hdr byte, n int) {
		h := bytes.Repeat([]byte{hdr}, reqHeaderSize)
		p := bytes.Repeat([]byte{hdr + 1}, n)
		if err := w.writeFrame(h, p); err != nil {
			t.Fatal(err)
		}
		want = append(append(want, h...), p...)
	}
	frame(1, 0)
	frame(3, 4096)
	if len(c.writes) != 0 {
		t.Fatalf("small frames written at once: %d writes", len(c.writes))
	}
	frame(5, 1<<20) // goes out with the two before it
	frame(7, 100)
	for i := 0; i < 40; i++ { // overflows the batch
		frame(9, 4096)
	}
	if err := w.flush(); err != nil {
		t.Fatal(err)
	}
	if got := bytes.Join(c.writes, nil); !bytes.Equal(got, want) {
		t.Fatal("the written stream differs from the frames in order")
	}
	if err := w.flush(); err != nil || len(bytes.Join(c.writes, nil)) != len(want) {
		t.Fatal("an empty flush wrote something")
	}
}
