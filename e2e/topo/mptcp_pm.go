package topo

import "strconv"

// configureMPTCP sets up the in-kernel MPTCP path manager of both
// namespaces so that one connection from the client to the server's
// path-1 address gets exactly one subflow per path:
//
//   - server: one "signal" endpoint per address on paths 2..N (announced
//     to the client with ADD_ADDR), with the join port if any (the kernel
//     then listens for MP_JOINs on address:port) and "backup" where
//     configured; the subflows limit N-1 lets it accept the N-1 MP_JOINs.
//   - client: no endpoints at all (a "subflow" endpoint per address would
//     make the client join from each local address to each announced
//     address as well, giving more subflows than paths); it accepts N-1
//     ADD_ADDRs and creates N-1 additional subflows, one to each
//     announced address, with the source address chosen by routing,
//     i.e. the client address of the same path.
//
// This is the only place that knows how MPTCP is configured, so that the
// iproute2 commands can be replaced by a netlink client.
func configureMPTCP(t *Topology) error {
	for _, ns := range []string{t.ClientNS, t.ServerNS} {
		if err := writeSysctl(ns, "net.mptcp.enabled", "1"); err != nil {
			return err
		}
	}
	extra := strconv.Itoa(len(t.Paths) - 1)
	cmds := [][]string{
		{"ip", "-n", t.ServerNS, "mptcp", "endpoint", "flush"},
		{"ip", "-n", t.ClientNS, "mptcp", "endpoint", "flush"},
		{"ip", "-n", t.ServerNS, "mptcp", "limits", "set", "subflows", extra, "add_addr_accepted", "0"},
		{"ip", "-n", t.ClientNS, "mptcp", "limits", "set", "subflows", extra, "add_addr_accepted", extra},
	}
	for i, p := range t.Paths {
		if i == 0 {
			continue // the address the client connects to
		}
		cmd := []string{"ip", "-n", t.ServerNS, "mptcp", "endpoint", "add", p.ServerAddr.String(),
			"dev", p.ServerIf, "id", strconv.Itoa(i + 1), "signal"}
		if t.JoinPort != 0 {
			cmd = append(cmd, "port", strconv.Itoa(t.JoinPort))
		}
		if p.Backup {
			cmd = append(cmd, "backup")
		}
		cmds = append(cmds, cmd)
	}
	for _, c := range cmds {
		if err := run(c[0], c[1:]...); err != nil {
			return err
		}
	}
	return nil
}
