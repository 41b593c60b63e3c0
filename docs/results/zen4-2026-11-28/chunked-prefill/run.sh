#!/bin/bash
# a streaming request and a ~1500-token prompt arriving 6 s later, against `draftwise serve` (method ar) at three
# --max-prefill-tokens: the stream's longest gap and the long prompt's time to first token
cd "$(dirname "$0")"
for budget in 2048 512 256; do
  draftwise serve --port 8132 --method ar --max-prefill-tokens $budget --prefix-cache-mb 0 > serve-$budget.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -s localhost:8132/health > /dev/null && break; sleep 1; done
  python mixed.py http://127.0.0.1:8132 mixed-$budget.json
  kill -TERM $pid; wait $pid
done
