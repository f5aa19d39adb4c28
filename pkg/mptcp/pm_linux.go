//go:build linux

package mptcp

import (
	"fmt"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
)

func dialPM() (*PM, error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("mptcp: dial generic netlink: %w", err)
	}
	// Best effort: with extended acks the kernel explains refusals
	// ("limit greater than maximum (8)"), which PMError carries.
	_ = c.SetOption(netlink.ExtendedAcknowledge, true)
	p, err := newPM(c)
	if err != nil {
		c.Close()
		return nil, err
	}
	return p, nil
}
