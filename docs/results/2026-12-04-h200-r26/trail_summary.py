"""Round 26: medians of run.sh STEP=trailab's bench files, main against this tree, per exact cell.

    python trail_summary.py <folder with trailab_{main,new}_N.txt>
"""
import glob,collections,statistics,sys
d=collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1]+"/trailab_*_*.txt")):
    tree=f.rsplit("/",1)[1].split("_")[1]
    for l in open(f):
        p=l.split()
        if len(p)>4 and p[0] in("v3","v4flash") and p[1]=="exact": d[(tree,p[0],int(p[2]))].append(float(p[3]))
for c in ("v3","v4flash"):
    for n in (1,8,32,128,512,2048,8192):
        m=d[("main",c,n)]; x=d[("new",c,n)]
        print(f"{c:8s} {n:5d} main {' / '.join(map(str,m)):28s} new {' / '.join(map(str,x)):28s} {(statistics.median(x)/statistics.median(m)-1)*100:+.1f}%")
