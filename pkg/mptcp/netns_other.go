//go:build !linux

package mptcp

func goInCallersNetns(f func()) { go f() }
