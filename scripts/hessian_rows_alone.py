"""The bench's `hessian` rows (B = 2112 on CUDA, 272 on the CPU) through one column alone.

``python scripts/hessian_rows_alone.py WAY [cuda|cpu] [COLUMN]`` (COLUMN default dynbatch),
one process per run: A compiled at the rows (static); B compiled at the rows, then at
K = 8 (dynamic, the bench's order: the rows then run the dynamic graph); C the rows marked
dynamic from the first call; D as B with the K = 8 call's size hint set to the rows' B.
Prints the median of 20 calls and the costliest kernels of three (torch.profiler).
docs/benchmarks.md, "`hessian` rows on CUDA", compares this with the bench's cell.
"""
import sys, time, torch
import dynbatch  # noqa
from dynbatch.bench import variants, workloads
from torch.profiler import profile, ProfilerActivity

way = sys.argv[1]
dev = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cuda")
tier = "cuda" if dev.type == "cuda" else "cpu"
torch.backends.cuda.matmul.allow_tf32 = False
prob = workloads.hessian(tier, [8], dev)[0]
rows, hvp = prob.cases[0], prob.cases[1]
col = sys.argv[3] if len(sys.argv) > 3 else "dynbatch"
r = variants.build(col, prob, dev)
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
ra, ha = r.prepare(rows), r.prepare(hvp)
if way == "A":
    r.call(*ra)
elif way == "B":
    r.call(*ra); r.call(*ha)
elif way == "C":
    torch._dynamo.mark_dynamic(ra[1], 0)
    r.call(*ra); r.call(*ha)
elif way == "D":
    r.call(*ra)
    torch._dynamo.mark_dynamic(ha[1], 0, hint_override=rows.batch)
    r.call(*ha)
for _ in range(3):
    r.call(*ra)
sync()
ts = []
for _ in range(20):
    t = time.perf_counter(); r.call(*ra); sync(); ts.append(time.perf_counter() - t)
ts.sort()
print(f"{col} way {way}: rows B={rows.batch} median {ts[10]*1e3:.3f} ms, graphs {r.compiles()}", flush=True)
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
with profile(activities=acts) as p:
    for _ in range(3):
        r.call(*ra)
    sync()
ev = sorted(p.key_averages(), key=lambda e: -(e.self_device_time_total if dev.type == "cuda" else e.self_cpu_time_total))
for e in ev[:9]:
    t = e.self_device_time_total if dev.type == "cuda" else e.self_cpu_time_total
    print(f"   {t/3/1000:8.3f} ms x{e.count/3:.0f} {e.key[:140]}", flush=True)
