//go:build !unix

package bench

// processCPU is not measured on this platform.
func processCPU() (user, sys float64) { return 0, 0 }
