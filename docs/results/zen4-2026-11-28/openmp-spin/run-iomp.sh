#!/usr/bin/env bash
# Intel's OpenMP runtime under pip's torch, as Intel's tuning guides set it up: LD_PRELOAD=libiomp5.so (LIBIOMP5:
# its path, e.g. from `pip download --no-deps intel-openmp`, unzipped). Two rounds, alternated: the checkout
# before the change (BEFORE) and after it (AFTER), draftwise imported first; AFTER with torch first; AFTER with
# pip's own GNU OpenMP (no preload) for reference.
cd "$(dirname "$0")"
for round in 1 2; do
  LD_PRELOAD=$LIBIOMP5 PYTHONPATH=$BEFORE python lib.py draftwise ar,draft,auto
  LD_PRELOAD=$LIBIOMP5 PYTHONPATH=$AFTER python lib.py draftwise ar,draft,auto
  LD_PRELOAD=$LIBIOMP5 PYTHONPATH=$AFTER python lib.py torch ar,draft,auto
  PYTHONPATH=$AFTER python lib.py draftwise ar,draft,auto
done
