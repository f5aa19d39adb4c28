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

package mptcp

// DefaultStaleLossCount is the stale_loss_cnt the driver's node plugin
// and storage agent raise their namespace's to. The kernel declares a
// subflow stale, and sends what it holds again on the others, after this
// many MPTCP-level retransmission intervals without progress. At its
// default of 4, subflows that are only queued behind many others are
// taken for dead: 32 volumes written at once, 128 subflows on 4 shaped
// 1 Gbit/s paths, got 80-88 % of the line, with the server receiving
// duplicate data about 2200 times a second (MPTcpExtDuplicateData); at 8,
// 92 % with a tenth of the duplicates (6: 89 %, 16 and 50: 93 %). A path
// that goes silent under a stream leaves the others without data for
// 0.15-0.7 s at 8, 0.15-0.3 s at 4, but 2.7 s at 16 and 3.5 s at 50.
const DefaultStaleLossCount = 8
