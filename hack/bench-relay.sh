#!/usr/bin/env bash
# What the relay costs, measured side by side in one run: our client
# through a relay against the same client direct, and a relay keeping
# acknowledged writes until a flush covers them (as it does) against one
# that keeps nothing. Prints MB/s and CPU per byte of each and the ratios.
#   hack/bench-relay.sh            # 3 runs of each case
#   COUNT=5 BENCHTIME=2s hack/bench-relay.sh
set -euo pipefail
cd "$(dirname "$0")/.."
COUNT=${COUNT:-3}
BENCHTIME=${BENCHTIME:-1s}
go test -run '^$' -bench '^BenchmarkRelay$' -benchtime "$BENCHTIME" -count "$COUNT" ./pkg/relay |
  awk '
    /^BenchmarkRelay\// {
      split($1, p, "/"); sub(/-[0-9]+$/, "", p[5])
      key = p[2] "/" p[3] "/" p[4]; mode = p[5]
      for (i = 2; i <= NF; i++) {
        if ($(i+1) == "MB/s") mbs[key, mode] += $i
        if ($(i+1) == "cpu-ns/B") cpu[key, mode] += $i
      }
      n[key, mode]++
      if (!(key in seen)) { seen[key] = 1; order[++k] = key }
    }
    END {
      printf "%-18s %9s %9s %9s %13s %12s %16s\n", "case (MB/s)", "direct", "relay", "noretain", "relay/direct", "relay/noret", "cpu relay/noret"
      for (j = 1; j <= k; j++) {
        key = order[j]
        d = (n[key, "direct"] ? mbs[key, "direct"] / n[key, "direct"] : 0)
        r = (n[key, "relay"] ? mbs[key, "relay"] / n[key, "relay"] : 0)
        nr = (n[key, "noretain"] ? mbs[key, "noretain"] / n[key, "noretain"] : 0)
        cr = (n[key, "relay"] ? cpu[key, "relay"] / n[key, "relay"] : 0)
        cn = (n[key, "noretain"] ? cpu[key, "noretain"] / n[key, "noretain"] : 0)
        printf "%-18s %9.0f %9.0f %9s %13.2f %12s %16s\n", key, d, r, (nr ? sprintf("%.0f", nr) : "-"), (d ? r / d : 0), (nr ? sprintf("%.2f", r / nr) : "-"), (cn ? sprintf("%.2f", cr / cn) : "-")
      }
      print "(means of the runs; cpu: process CPU per byte moved)"
    }'
