import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ws_sim import item_geometry
SMS=132
def bound(qls, filt, maxq, bm=128):
    B=len(qls); T=sum(qls)
    if B<=0 or T<=0 or maxq<=0: return 0
    seqs=min(B,T)
    if filt<0: seqs=min(seqs, T//(1-filt))
    return min((T+(bm-1)*seqs)//bm, seqs*((maxq+bm-1)//bm))
def owned(ql,f): return ql>0 and (f==0 or ((ql<=abs(f))==(f>0)))
def route(qls, ctx, hq, hkv, d, bs, causal):
    out=[]; S=len(qls); T=sum(qls); maxq=max(qls)
    if maxq==0 or T==0: return ['nothing']
    if maxq==1 and T==S: return ['run_decode (plain)']
    minq = T-(S-1)*maxq if T>(S-1)*maxq else 0
    pack_ok = hq>=2*hkv
    def tiled(f):
        if 8<=bs<=256:
            ctas=bound(qls,f,maxq)*hq
            if causal and ctas<=SMS: return f'WS mirror (f={f}, ctas={ctas})', True
            if 2*ctas>=SMS: return f'WS plain (f={f}, ctas={ctas})', False
        rb=S*hq*((maxq+127)//128)
        return (f'wgmma {"Large" if rb>=2*SMS else "Small"} (f={f})', None)
    if maxq>1:
        if pack_ok and minq<=16:
            out.append('packed mma (q 2..16)')
            if maxq>16: out.append(tiled(-16))
            f=-16
        else:
            out.append(tiled(-1)); f=-1
    if minq<=1: out.append('decode PQ (q==1 rows)')
    # geometry of WS items
    geo=[]
    for o in out:
        if isinstance(o,tuple) and o[1] is not None:
            for ql,c in zip(qls,ctx):
                if not owned(ql,f): continue
                for mb in range((ql+127)//128):
                    geo.append((ql,c,mb,item_geometry(ql,min(c,10**9),causal,o[1],mb)))
    return out, geo
if __name__=='__main__':
    import ast
    print(route(*ast.literal_eval(sys.argv[1])))
