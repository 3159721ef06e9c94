"""Force training of a dynbatch-compiled model under DistributedDataParallel.

Two processes on the CPU (gloo), each with its own atoms: the compiled model's
parameter grads after ``loss.backward()`` equal those of the same step with an
eager model under DDP (grads averaged over the ranks), and the compiled paths ran
(docs/usage.md, "Training with forces").  NCCL on GPUs is the same program with
``backend="nccl"`` and one device per rank.
"""

from __future__ import annotations

import textwrap

import pytest
import torch.distributed

from conftest import run_two_ranks

WORKER = textwrap.dedent('''
    import os, sys
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel as DDP
    import dynbatch

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

    def energy(net, pos):
        d = pos[:, None, :] - pos[None, :, :]
        r = ((d * d).sum(-1) + 1).sqrt()
        return net(r.unsqueeze(-1)).sum()

    class Potential(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model()

        def forward(self, pos):
            return energy(self.net, pos)

    def step(ddp, pos, f_ref):
        pos = pos.clone().requires_grad_()
        e = ddp(pos)
        f = -torch.autograd.grad(e, pos, create_graph=True)[0]
        ((e - 0.5) ** 2 + ((f - f_ref) ** 2).mean()).backward()
        return [p.grad.clone() for p in ddp.parameters()]

    def run(rank, world, store):
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
        g = torch.Generator().manual_seed(rank)
        eager = DDP(Potential())
        compiled_module = Potential()
        # torch.compile, not conftest's compile_dynbatch: this runs as a script of its own.
        compiled = DDP(torch.compile(compiled_module, backend="dynbatch",
                                     options={"dynbatch.inner_compiler": "aot_eager",
                                              "dynbatch.on_unsupported": "error"}))
        for i in range(3):
            pos = torch.randn(5, 3, generator=g, dtype=torch.float64)
            f_ref = torch.randn(5, 3, generator=g, dtype=torch.float64)
            eager.zero_grad(); compiled.zero_grad()
            want, got = step(eager, pos, f_ref), step(compiled, pos, f_ref)
            for w, c in zip(want, got):
                torch.testing.assert_close(c, w)
        c = dynbatch.counters()
        assert c.get("outside_eager", 0) == 0 and c.get("outside_grads_at_forward", 0) >= 1, c
        print(f"rank {rank} ok {c}", flush=True)
        # Both ranks reach the teardown together: once in seven runs gloo's destroy hung with
        # both ranks done (pytorch/pytorch#75097: a barrier first is the known remedy).
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(run, args=(2, sys.argv[1]), nprocs=2)
''')


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="this torch has no gloo backend")
def test_force_training_under_ddp_matches_eager_ddp(tmp_path):
    run_two_ranks(WORKER, tmp_path)
