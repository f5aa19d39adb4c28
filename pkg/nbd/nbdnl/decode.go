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
	"errors"
	"fmt"

	"github.com/mdlayher/netlink"
)

// DeviceStatus is one entry of a STATUS reply.
type DeviceStatus struct {
	Index uint32
	// Connected is NBD_DEVICE_CONNECTED: the device holds a configuration,
	// that is, it was connected and is not torn down yet. (Opening an
	// unconfigured /dev/nbdN also gives it one while it stays open.)
	Connected bool
}

// LinkDead is an NBD_CMD_LINK_DEAD event: a connection of device Index
// failed and the device waits for a replacement (Reconfigure) until its
// dead-connection timeout runs out.
type LinkDead struct {
	Index uint32
}

// decodeStatus decodes the attributes of a STATUS reply:
// NBD_ATTR_DEVICE_LIST [NBD_DEVICE_ITEM [NBD_DEVICE_INDEX, NBD_DEVICE_CONNECTED]]...
func decodeStatus(b []byte) ([]DeviceStatus, error) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return nil, err
	}
	var (
		devs    []DeviceStatus
		sawList bool
	)
	for ad.Next() {
		if ad.Type() != attrDeviceList {
			continue
		}
		sawList = true
		ad.Nested(func(nad *netlink.AttributeDecoder) error {
			for nad.Next() {
				if nad.Type() != attrDeviceItem {
					continue
				}
				nad.Nested(func(iad *netlink.AttributeDecoder) error {
					d, err := decodeDeviceItem(iad)
					if err != nil {
						return err
					}
					devs = append(devs, d)
					return nil
				})
			}
			return nil
		})
	}
	if err := ad.Err(); err != nil {
		return nil, fmt.Errorf("decode status reply: %w", err)
	}
	if !sawList {
		return nil, errors.New("decode status reply: no device list")
	}
	return devs, nil
}

func decodeDeviceItem(ad *netlink.AttributeDecoder) (DeviceStatus, error) {
	var (
		d        DeviceStatus
		hasIndex bool
	)
	for ad.Next() {
		switch ad.Type() {
		case attrDeviceIndex:
			d.Index = ad.Uint32()
			hasIndex = true
		case attrDeviceConnected:
			d.Connected = ad.Uint8() != 0
		}
	}
	if err := ad.Err(); err != nil {
		return DeviceStatus{}, err
	}
	if !hasIndex {
		return DeviceStatus{}, errors.New("device item without index")
	}
	return d, nil
}

// decodeIndex decodes the NBD_ATTR_INDEX that a CONNECT reply and a
// LINK_DEAD event carry.
func decodeIndex(b []byte) (uint32, error) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return 0, err
	}
	var (
		index    uint32
		hasIndex bool
	)
	for ad.Next() {
		if ad.Type() == attrIndex {
			index = ad.Uint32()
			hasIndex = true
		}
	}
	if err := ad.Err(); err != nil {
		return 0, err
	}
	if !hasIndex {
		return 0, errors.New("no index attribute")
	}
	return index, nil
}

// decodeLinkDead decodes the attributes of an NBD_CMD_LINK_DEAD event.
func decodeLinkDead(b []byte) (LinkDead, error) {
	index, err := decodeIndex(b)
	if err != nil {
		return LinkDead{}, fmt.Errorf("decode link-dead event: %w", err)
	}
	return LinkDead{Index: index}, nil
}
