// Package guest holds tests that run inside the e2e VM (see package
// internal/testenv/vm), where MPNBD_IN_VM=1 is set; elsewhere they skip.
// They check that the guest provides what the NBD node tests need.
package guest
