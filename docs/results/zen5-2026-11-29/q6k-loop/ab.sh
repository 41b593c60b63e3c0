# usage: ab.sh ROUNDS SIZES tree1 tree2 ...  -> lines "tree json"
R=$1; S=$2; shift 2
for r in $(seq $R); do for t in "$@"; do
  echo "$t $(PYTHONPATH=$t python abfwd.py $S 3 2>/dev/null | tail -1)"
done; done
