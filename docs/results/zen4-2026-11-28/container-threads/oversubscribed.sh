#!/bin/bash
# inside a 1-CPU CFS quota: --threads as os.cpu_count() would give on a bigger host (8, 16) against the default now (1)
# the cgroup: mkdir /sys/fs/cgroup/cpu/dwtest; echo 100000 > /sys/fs/cgroup/cpu/dwtest/cpu.cfs_quota_us (period 100000)
quota() { sh -c 'echo $$ > /sys/fs/cgroup/cpu/dwtest/cgroup.procs; exec "$@"' sh "$@"; }
for round in 1 2; do
  for t in 8 16 default; do
    for m in ar draft; do
      a=(); [ $t != default ] && a=(--threads $t)
      out=$(quota python -m draftwise.cli generate "def quicksort(arr):" --method $m --max-tokens 96 --temperature 0 --json "${a[@]}" 2>/dev/null)
      echo "quota threads=$t $m $(echo "$out" | python -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; print(s["tokens_per_s"], s["wall_s"])')"
    done
  done
done
