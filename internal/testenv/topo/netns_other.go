//go:build !linux

package topo

import (
	"errors"
	"runtime"
)

var errUnsupported = errors.New("topo: network namespaces need Linux (GOOS=" + runtime.GOOS + ")")

// InClient is only supported on Linux.
func (t *Topology) InClient(fn func() error) error { return errUnsupported }

// InServer is only supported on Linux.
func (t *Topology) InServer(fn func() error) error { return errUnsupported }

// InNetns is only supported on Linux.
func InNetns(ns string, fn func() error) error { return errUnsupported }

func WriteSysctl(ns, key, value string) error { return errUnsupported }

func nameCallerNetns(string) error { return errUnsupported }
