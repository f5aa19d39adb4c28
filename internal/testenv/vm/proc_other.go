//go:build !linux

package vm

import "os/exec"

func setProcAttr(cmd *exec.Cmd) {}
