package vm

import (
	"os/exec"
	"syscall"
)

// setProcAttr makes the kernel kill qemu if the test process dies first.
func setProcAttr(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
