#!/bin/bash
# ar and draft on quicksort, 96 tokens: inside a 1-CPU CFS quota (cgroup v1 cpu:/dwtest) and under taskset -c 0,
# the checkout before (threads = os.cpu_count() = 2) and after (cpus.usable_cores() = 1). BEFORE / AFTER: the
# two checkouts; the cgroup: mkdir /sys/fs/cgroup/cpu/dwtest; echo 100000 > /sys/fs/cgroup/cpu/dwtest/cpu.cfs_quota_us
run() {  # $1 label, $2 checkout, rest: prefix command
  local label=$1 co=$2; shift 2
  for m in ar draft; do
    out=$(PYTHONPATH=$co "$@" python -m draftwise.cli generate "def quicksort(arr):" --method $m --max-tokens 96 --temperature 0 --json 2>/dev/null)
    echo "$label $m $(echo "$out" | python -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; print(s["tokens_per_s"], s["wall_s"], s.get("threads"))')"
  done
}
quota() { sh -c 'echo $$ > /sys/fs/cgroup/cpu/dwtest/cgroup.procs; exec "$@"' sh "$@"; }
for round in 1 2; do
  run quota-before $BEFORE quota env
  run quota-after $AFTER quota env
  run taskset-before $BEFORE taskset -c 0
  run taskset-after $AFTER taskset -c 0
done
