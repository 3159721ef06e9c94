"""Side by side, in one run: stock torch.compile (trace_autograd_ops=True) vs dynbatch.

Figures for a 3-layer tanh MLP batched VJP: graphs compiled over a batch-size
sweep, nodes in the graph Inductor receives at two batch sizes, and first-call
(compile) time at B=8 and B=512.  Each measurement runs in a fresh subprocess
with a time limit, so a crash or a runaway compile is reported, not hidden.

    python scripts/stock_vs_dynbatch.py [--device cpu|cuda] [--timeout 300]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

SWEEP = [2, 3, 5, 8, 13, 32, 64, 100, 128]
WIDTH, N = 32, 4


def _program(device):
    import torch

    g = torch.Generator().manual_seed(0)
    Ws = [(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5).to(device) for _ in range(3)]

    def vjp(x, V):
        y = x
        for W in Ws:
            y = torch.tanh(y @ W)
        return torch.autograd.grad(y, x, V, is_grads_batched=True)[0]

    return vjp


def _backend(variant, nodes):
    """Inductor, recording the size of the aten graph it receives."""
    import torch
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, ex, **kw):
        nodes.append(len(gm.graph.nodes))
        return compile_fx_inner(gm, ex, **kw)

    if variant == "stock":
        torch._dynamo.config.trace_autograd_ops = True
        return lambda gm, ex: compile_fx(gm, ex, inner_compile=inner)
    return "dynbatch"  # its compile records hold the same node counts


def worker(variant, task, device, batch_sizes):
    import torch

    torch._inductor.config.fx_graph_cache = False  # measure real compiles
    vjp = _program(device)
    nodes: list[int] = []
    backend = _backend(variant, nodes)
    if variant == "dynbatch":
        import dynbatch

        def graphs_seen():
            nodes[:] = [c for r in dynbatch.compile_records() for c in r.aten_node_counts]
    else:
        def graphs_seen():
            pass
    x = torch.randn(N, WIDTH, device=device, requires_grad=True)
    out = {"variant": variant, "task": task}
    if task == "sweep":
        compiled = torch.compile(vjp, backend=backend, fullgraph=True)
        done = []
        for B in batch_sizes:
            V = torch.randn(B, N, WIDTH, device=device)
            torch.testing.assert_close(compiled(x, V), vjp(x, V), rtol=1e-4, atol=1e-4)
            done.append(B)
            graphs_seen()
            out.update(batch_sizes_done=done, graphs=len(nodes))
            print(json.dumps(out), flush=True)
    else:  # one static compile at batch_sizes[0]: node count and first-call time
        (B,) = batch_sizes
        compiled = torch.compile(vjp, backend=backend, fullgraph=True, dynamic=False)
        V = torch.randn(B, N, WIDTH, device=device)
        start = time.perf_counter()
        compiled(x, V)
        if device == "cuda":
            torch.cuda.synchronize()
        graphs_seen()
        out.update(B=B, first_call_s=round(time.perf_counter() - start, 2), nodes=nodes[0])
        print(json.dumps(out), flush=True)


def run(variant, task, device, batch_sizes, timeout):
    cmd = [sys.executable, __file__, "--worker", variant, task, device, ",".join(map(str, batch_sizes))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        last = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        result = json.loads(last[-1]) if last else {"variant": variant, "task": task}
        if proc.returncode != 0:
            err = re.findall(r"^\S*(?:Error|Exception)\b.*$", proc.stderr, re.M)
            result["crashed"] = (err[-1] if err else proc.stderr.strip()[-200:])[:300]
    except subprocess.TimeoutExpired as e:
        last = [l for l in (e.stdout or b"").decode().splitlines() if l.startswith("{")]
        result = json.loads(last[-1]) if last else {"variant": variant, "task": task}
        result["timed_out_after_s"] = timeout
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--worker", nargs=4)
    args = p.parse_args()
    if args.worker:
        variant, task, device, sizes = args.worker
        worker(variant, task, device, [int(s) for s in sizes.split(",")])
        return
    import torch

    print(f"# torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    for variant in ("stock", "dynbatch"):
        print(json.dumps(run(variant, "sweep", args.device, SWEEP, args.timeout)))
        for B in (8, 512):
            print(json.dumps(run(variant, "static", args.device, [B], args.timeout)))


if __name__ == "__main__":
    main()
