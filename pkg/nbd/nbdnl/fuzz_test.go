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

package nbdnl

import (
	"reflect"
	"testing"
)

func FuzzDecodeStatus(f *testing.F) {
	f.Add(encodeStatusReply(nil))
	f.Add(encodeStatusReply([]DeviceStatus{{Index: 0, Connected: true}, {Index: 7}}))
	f.Add(encodeIndex(1))
	f.Fuzz(func(t *testing.T, b []byte) {
		devs, err := decodeStatus(b)
		if err != nil {
			return
		}
		// Whatever decodes must survive a round trip through the kernel's
		// encoding unchanged.
		again, err := decodeStatus(encodeStatusReply(devs))
		if err != nil {
			t.Fatalf("re-decode: %v", err)
		}
		if len(devs) == 0 && len(again) == 0 {
			return
		}
		if !reflect.DeepEqual(devs, again) {
			t.Fatalf("round trip: %+v became %+v", devs, again)
		}
	})
}

func FuzzDecodeLinkDead(f *testing.F) {
	f.Add(encodeIndex(0))
	f.Add(encodeIndex(4095))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		ev, err := decodeLinkDead(b)
		if err != nil {
			return
		}
		again, err := decodeLinkDead(encodeIndex(ev.Index))
		if err != nil || again != ev {
			t.Fatalf("round trip: %+v became %+v, %v", ev, again, err)
		}
	})
}
