#!/bin/bash
# draftwise generate twice over one --prefix-cache-dir (two processes), then ar without a cache; the three token lists
set -e
python make_doc.py
DIR=$(mktemp -d)
for i in 1 2; do draftwise generate "$(cat doc.txt)" --method draft --max-tokens 32 --prefix-cache-dir "$DIR" --json > run$i.json; done
draftwise generate "$(cat doc.txt)" --method ar --max-tokens 32 --json > run0.json
python -c "
import json
r = [json.load(open(f'run{i}.json')) for i in range(3)]
print('same tokens as ar:', [x['token_ids'] == r[0]['token_ids'] for x in r[1:]])
for i, x in enumerate(r): print(f'run{i}', {k: x['stats'].get(k) for k in ('prefill_s', 'cached_tokens', 'wall_s')})"
du -sh "$DIR"/*
rm -rf "$DIR"
