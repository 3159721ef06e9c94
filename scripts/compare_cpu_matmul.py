"""dynbatch.cpu_matmul="aten" vs "auto" on the sweep and mlp_jacobian workloads, timed interleaved.

    taskset -c 0 python scripts/compare_cpu_matmul.py 1     # one core, one thread

Both columns are called in a shuffled order in every round for 3 s per case,
so a machine that drifts slows both alike; prints medians and auto/aten.
"""
import torch, time, random, sys
torch.set_num_threads(int(sys.argv[1]))
import dynbatch
from dynbatch.bench import workloads, variants
dev=torch.device('cpu')
probs=workloads.build('sweep','cpu',[1,16,256,1024],dev,None)+workloads.build('mlp_jacobian','cpu',None,dev,None)
def t1(f):
    t=time.perf_counter(); f(); return time.perf_counter()-t
for p in probs:
    fns={k:torch.compile(variants.batched_program(p),backend='dynbatch',options={'dynbatch.cpu_matmul':k}) for k in ('aten','auto')}
    for c in p.cases:
        calls={k:(lambda f=f,c=c: f(c.x,c.cotangents)) for k,f in fns.items()}
        for k in calls: calls[k](); calls[k]()
        ts={k:[] for k in calls}; end=time.perf_counter()+3
        while time.perf_counter()<end:
            ks=list(calls); random.shuffle(ks)
            for k in ks: ts[k].append(t1(calls[k]))
        med={k:sorted(v)[len(v)//2] for k,v in ts.items()}
        print(p.name,c.label,{k:f"{v*1e3:.3f}ms" for k,v in med.items()}, f"auto/aten={med['auto']/med['aten']:.2f}", flush=True)
