#!/usr/bin/env bash
# two rounds, alternated: the checkout before the change and after it, torch imported first; after it with
# draftwise first. BEFORE / AFTER: the two checkouts' roots.
cd "$(dirname "$0")"
for round in 1 2; do
  PYTHONPATH=$BEFORE python lib.py torch ar,draft,auto
  PYTHONPATH=$AFTER python lib.py torch ar,draft,auto
  PYTHONPATH=$AFTER python lib.py draftwise ar,draft,auto
done
