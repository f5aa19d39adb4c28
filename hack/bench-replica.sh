#!/usr/bin/env bash
# What a replica costs, measured side by side in one run on the same shaped
# paths: a client on a volume whose primary forwards every change to one
# replica, against the same client on an unreplicated volume of the same
# primary (pkg/replica BenchmarkMirror; needs root for the namespaces).
# Prints MB/s of each, their ratio, each against the client paths' line
# rate, and the ratio of CPU per byte; then the rebuilds (BenchmarkRebuild).
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

# Rebuilds on the storage-to-storage paths (pkg/replica BenchmarkRebuild):
# a full copy of a volume full of data and of one a tenth written (the
# rest goes as WRITE_ZEROES), and the catch-up of a replica that missed
# writes to a tenth of the chunks; each against the paths' line rate.
go test -run '^$' -bench '^BenchmarkRebuild$' -benchtime 1x -count "$COUNT" -timeout 30m ./pkg/replica |
  awk '
    /^BenchmarkRebuild\// {
      split($1, p, "/"); key = p[2]; if (p[3] != "") key = key "/" p[3]; sub(/-[0-9]+$/, "", key)
      for (i = 2; i <= NF; i++) {
        if ($(i+1) == "ns/op") ns[key] += $i
        if ($(i+1) == "vol-MB/s") vol[key] += $i
        if ($(i+1) == "data-MB/s") data[key] += $i
        if ($(i+1) == "line-MB/s") line = $i
      }
      n[key]++
      if (!(key in seen)) { seen[key] = 1; order[++k] = key }
    }
    END {
      printf "\n%-16s %10s %10s %11s %13s\n", "rebuild (256 MiB)", "seconds", "vol-MB/s", "data-MB/s", "data/line"
      for (j = 1; j <= k; j++) {
        key = order[j]
        printf "%-16s %10.2f %10.0f %11.0f %13.2f\n", key, ns[key] / n[key] / 1e9, vol[key] / n[key], data[key] / n[key], (line ? data[key] / n[key] / line : 0)
      }
      printf "(means of %d runs; line: the storage-to-storage paths, %.0f MB/s)\n", '"$COUNT"', line
    }'

# What a full rebuild leaves to the volume's own writes (pkg/replica
# BenchmarkRebuildForeground): 1 MiB writes at QD8 to a replicated volume
# whose replica is in sync, then to one whose replica is being rebuilt
# whole over the same storage-to-storage paths; and the rebuild's copy
# rate meanwhile.
go test -run '^$' -bench '^BenchmarkRebuildForeground$' -benchtime 1x -count "$COUNT" -timeout 30m ./pkg/replica |
  awk '
    /^BenchmarkRebuildForeground\// {
      split($1, p, "/"); key = p[2]; sub(/-[0-9]+$/, "", key)
      for (i = 2; i <= NF; i++) {
        if ($(i+1) == "fg-MB/s") fg[key] += $i
        if ($(i+1) == "copy-MB/s") cp[key] += $i
      }
      n[key]++
    }
    END {
      a = (n["alone"] ? fg["alone"] / n["alone"] : 0)
      r = (n["rebuilding"] ? fg["rebuilding"] / n["rebuilding"] : 0)
      c = (n["rebuilding"] ? cp["rebuilding"] / n["rebuilding"] : 0)
      printf "\n%-26s %12s %12s %12s %16s\n", "writes during a rebuild", "alone MB/s", "rebuild MB/s", "ratio", "copy MB/s"
      printf "%-26s %12.0f %12.0f %12.2f %16.0f\n", "1 MiB write, QD8", a, r, (a ? r / a : 0), c
      printf "(means of %d runs)\n", '"$COUNT"'
    }'
