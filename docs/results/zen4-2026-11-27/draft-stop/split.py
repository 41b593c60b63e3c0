import ast, statistics, sys
rows=[]
for l in open(sys.argv[1]):
    if l[0].isdigit() and ' {' in l:
        p=l.split(); i=int(p[0]); m=p[1]; d=ast.literal_eval(l[l.index('{'):])
        rows.append((i,m,d))
ms = sorted({m for _, m, _ in rows})
for m in ms:
  for name, sel in (("code", lambda i: i<6), ("spec", lambda i: i>=6)):
    r=[d for i,mm,d in rows if sel(i) and mm==m]
    base = min(r[0]); 
    for v in sorted(r[0]):
      if v == base: continue
      tot=sum(d[base] for d in r)/sum(d[v] for d in r)
      med=statistics.median(d[base]/d[v] for d in r)
      print(m, name, v, f"total x{tot:.3f} median x{med:.3f} n={len(r)}")
