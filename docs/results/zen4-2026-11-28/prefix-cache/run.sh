#!/bin/bash
# the same conversation against `draftwise serve` with the default prefix cache and with --prefix-cache-mb 0
cd "$(dirname "$0")"  # writes turns-MB.json, metrics-MB.txt and serve-MB.log here
for mb in 512 0; do
  draftwise serve --port 8131 --prefix-cache-mb $mb > serve-$mb.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -s localhost:8131/health > /dev/null && break; sleep 1; done
  python conversation.py http://127.0.0.1:8131 turns-$mb.json
  curl -s localhost:8131/metrics | grep -E "^draftwise_prefix_cache|^draftwise_prompt_tokens" > metrics-$mb.txt
  kill -TERM $pid; wait $pid
done
