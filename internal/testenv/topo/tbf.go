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

package topo

import "strconv"

// Shaping parameters of the tbf qdisc on each veth end.
//
// The veth devices keep GSO/TSO enabled (fast; the stack hands the qdisc
// super-packets of up to 64 KiB). tbf cannot send a packet larger than
// its bucket: it software-segments such packets (costly) or drops them,
// so the bucket must comfortably exceed the largest GSO packet. tbf
// charges every segment's headers (1514 bytes on the wire per 1448 bytes
// of payload), so the goodput ceiling of a 1 Gbit/s path is ~119.5 MB/s
// and of 4 paths ~478 MB/s.
//
// Measured with 4 parallel TCP streams (iperf3, one per path, 1 Gbit/s
// each, with the host default bbr; cubic gave the same for the chosen
// values):
//
//	burst 16 KiB,  latency 1 ms:  ~240 MB/s, thousands of retransmissions
//	burst 64 KiB,  latency 2 ms:  ~270 MB/s, thousands of retransmissions
//	burst 128 KiB, latency 2 ms:  ~450 MB/s
//	burst 128 KiB, latency 5 ms:  330..478 MB/s (unstable)
//	burst 256 KiB, latency 10 ms: 477..478 MB/s, no retransmissions
//
// hence a bucket of 256 KiB (4 GSO packets; 2 ms at 1 Gbit/s) and 10 ms
// of queue (1.25 MB at 1 Gbit/s).
const (
	// MinBurstBytes is the smallest tbf bucket used for any rate.
	MinBurstBytes = 256 << 10
	// BurstTimeMicros is the bucket size in time at the shaped rate when that
	// is larger than MinBurstBytes (rates above 1 Gbit/s).
	BurstTimeMicros = 2000
	// LatencyMillis bounds the time a packet may wait in the tbf queue.
	LatencyMillis = 10
)

// TBFArgs returns the tc arguments ("tbf rate ...") for a path of
// rateMbit Mbit/s.
func TBFArgs(rateMbit int) []string {
	burst := int64(rateMbit) * 1_000_000 / 8 * BurstTimeMicros / 1_000_000
	if burst < MinBurstBytes {
		burst = MinBurstBytes
	}
	return []string{
		"tbf",
		"rate", strconv.Itoa(rateMbit) + "mbit",
		"burst", strconv.FormatInt(burst, 10),
		"latency", strconv.Itoa(LatencyMillis) + "ms",
	}
}
