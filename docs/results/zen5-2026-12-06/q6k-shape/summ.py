import json,collections,statistics,sys
d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    t,j=l.split(' ',1); r=json.loads(j); d[t].append(r['forward_s'])
for t,rs in d.items():
    ks=list(rs[0].keys())
    print(t, "  ".join(f"T={k}: " + "/".join(f"{r[k]*1e3:.1f}" for r in rs) for k in ks))
