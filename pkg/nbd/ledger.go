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
	"errors"
	"fmt"
)

// CmdSettle is a request type of ours, sent by a replicated volume's
// primary to a replica on the connection that carries its forwards
// (docs/replication.md, "Unsettled writes"). It is a mark in the stream of
// forwards: Offset numbers it (the marks of a connection are numbered 1,
// 2, 3, ... in the order they are sent) and Length says that every forward
// sent on the connection before the mark of that number has settled (0:
// none yet). It carries no data and its reply no data. A server answers
// it on an export with a Ledger, in the order the connection sent it
// among its changes; elsewhere it is EINVAL, as any command a server does
// not know. The number is far from the protocol's own (0-7 today).
const CmdSettle uint16 = 0x4d50

// Ledger hears, per connection of an export and in the order the client
// sent them, the ranges its changes touch and its settle marks: what a
// replica needs to tell which of its primary's forwards may not have
// settled when the primary went.
type Ledger interface {
	// Open is called as a connection starts transmitting on the export.
	Open(c ConnInfo) LedgerConn
}

// LedgerConn is a Ledger's view of one connection. Its calls come from
// the connection's reader, one at a time.
type LedgerConn interface {
	// Changed: a write, trim or write-zeroes of [off, off+length) was
	// read (before it runs: whether it succeeds does not matter).
	Changed(off, length uint64)
	// Settled: mark number mark was read, saying that every change sent
	// before the mark numbered settled has settled (settled < mark; 0
	// says nothing).
	Settled(mark, settled uint64)
	// Close: the connection ended.
	Close()
}

// errSettleMarks: a client of several connections cannot order its
// forwards with marks.
var errSettleMarks = errors.New("nbd: settle marks need a client of one connection")

// Settle sends settle mark number mark, saying that every change sent
// before the mark numbered settled has settled (CmdSettle). The client
// must have one connection: the marks order the changes of one.
func (cl *Client) Settle(mark uint64, settled uint32) error {
	if cl.rt == nil && len(cl.conns) != 1 {
		return errSettleMarks
	}
	if uint64(settled) >= mark {
		return fmt.Errorf("nbd: settle mark %d cannot speak for mark %d", mark, settled)
	}
	return cl.do(Request{Type: CmdSettle, Offset: mark, Length: settled}, nil, nil)
}
