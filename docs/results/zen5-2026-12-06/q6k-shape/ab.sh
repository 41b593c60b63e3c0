# usage (from this folder, each tree a copy of the draftwise package of one build): bash ab.sh ROUNDS SIZES tree1 tree2 ...
# abfwd.py: ../../zen5-2026-11-29/q6k-loop/abfwd.py (bench-forward's timing in one process)
R=$1; S=$2; shift 2
for r in $(seq $R); do for t in "$@"; do
  echo "$t $(PYTHONPATH=$t python3 ../../zen5-2026-11-29/q6k-loop/abfwd.py $S 3 2>/dev/null | tail -1)"
done; done
