#!/usr/bin/env bash
# What a replica costs, measured side by side in one run on the same shaped
# paths: a client on a volume whose primary forwards every change to one
# replica, against the same client on an unreplicated volume of the same
# primary (pkg/replica BenchmarkMirror; needs root for the namespaces).
# Prints MB/s of each, their ratio, each against the client paths' line
# rate, and the ratio of CPU per byte.
#   hack/bench-replica.sh            # 3 runs of each case
#   COUNT=5 BENCHTIME=3s hack/bench-replica.sh
set -euo pipefail
cd "$(dirname "$0")/.."
COUNT=${COUNT:-3}
BENCHTIME=${BENCHTIME:-2s}
go test -run '^$' -bench '^BenchmarkMirror$' -benchtime "$BENCHTIME" -count "$COUNT" -timeout 30m ./pkg/replica |
  awk '
    /^BenchmarkMirror\// {
      split($1, p, "/"); sub(/-[0-9]+$/, "", p[5])
      key = p[2] "/" p[3] "/" p[4]; mode = p[5]
      for (i = 2; i <= NF; i++) {
        if ($(i+1) == "MB/s") mbs[key, mode] += $i
        if ($(i+1) == "cpu-ns/B") cpu[key, mode] += $i
        if ($(i+1) == "line-MB/s") line = $i
      }
      n[key, mode]++
      if (!(key in seen)) { seen[key] = 1; order[++k] = key }
    }
    END {
      printf "%-18s %9s %11s %12s %12s %12s %14s\n", "case (MB/s)", "single", "replicated", "repl/single", "single/line", "repl/line", "cpu repl/single"
      for (j = 1; j <= k; j++) {
        key = order[j]
        s = (n[key, "single"] ? mbs[key, "single"] / n[key, "single"] : 0)
        r = (n[key, "replicated"] ? mbs[key, "replicated"] / n[key, "replicated"] : 0)
        cs = (n[key, "single"] ? cpu[key, "single"] / n[key, "single"] : 0)
        cr = (n[key, "replicated"] ? cpu[key, "replicated"] / n[key, "replicated"] : 0)
        printf "%-18s %9.0f %11.0f %12.2f %12.2f %12.2f %14.2f\n", key, s, r, (s ? r / s : 0), (line ? s / line : 0), (line ? r / line : 0), (cs ? cr / cs : 0)
      }
      printf "(means of %d runs; line: the client paths, %.0f MB/s; cpu: process CPU per byte moved)\n", '"$COUNT"', line
    }'
