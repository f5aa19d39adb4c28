//go:build !linux

package relay

// GuardAgainstReclaim is only implemented on Linux.
func GuardAgainstReclaim() error { return ErrUnsupported }
