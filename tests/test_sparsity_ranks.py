"""A sparse Hessian's products shared across two ranks (gloo on the CPU): each rank
computes its share of the colours with its own compiled batched grad, every rank gets
eager's whole Hessian.  NCCL is the same call with a GPU per rank (docs/usage.md)."""

from __future__ import annotations

import textwrap

import pytest
import torch.distributed

from conftest import run_two_ranks

WORKER = textwrap.dedent('''
    import sys
    import torch, torch.distributed as dist
    import torch.multiprocessing as mp
    import dynbatch
    from dynbatch.bench import sparse_problems as sp

    def run(rank, world, store):
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
        x, (i, j) = sp.lennard_jones_problem(64, cutoff=1.6)
        want = torch.autograd.functional.hessian(lambda t: sp.lennard_jones(t, i, j), x)
        opts = {"dynbatch.inner_compiler": "aot_eager", "dynbatch.on_unsupported": "error"}
        got = dynbatch.hessian(sp.lennard_jones, x, i, j, sparse=True, process_group=True, options=opts)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-10)
        csr = dynbatch.hessian(sp.lennard_jones, x, i, j, sparse=True, layout=torch.sparse_csr,
                               process_group=True, options=opts)
        torch.testing.assert_close(csr.to_dense(), want.reshape(192, 192), rtol=1e-12, atol=1e-10)
        c = dynbatch.counters()
        colours = c["colours"] // c["grads_compressed"]
        # each rank computed its share of the colours, about half, twice
        assert c["products_here"] == 2 * len(range(rank, colours, world)), c
        print(f"rank {rank} ok {c}", flush=True)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(run, args=(2, sys.argv[1]), nprocs=2)
''')


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="this torch has no gloo backend")
def test_a_sparse_hessian_shared_across_two_ranks_equals_eager(tmp_path):
    run_two_ranks(WORKER, tmp_path)


def test_a_process_group_without_torch_distributed_is_a_user_error():
    import dynbatch
    from dynbatch.bench import sparse_problems as sp

    x, (i, j) = sp.lennard_jones_problem(8, cutoff=1.6)
    with pytest.raises(ValueError, match="not initialised"):
        dynbatch.hessian(sp.lennard_jones, x, i, j, process_group=True)


@pytest.mark.slow  # two rank processes, each compiling its products with Inductor (a minute on 2 cores)
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="this torch has no gloo backend")
def test_the_benchs_two_rank_column_gives_the_dense_hessian():
    import os

    from dynbatch.bench import sparse_hessian

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip(reason="the two-rank column needs two cores")
    row = sparse_hessian._child("lennard_jones", "dynbatch_csr_2ranks", 27, 2, 1)
    assert row["column"] == "dynbatch_csr_2ranks" and row["colours"] and row["max_diff_from_dense"] < 1e-10, row
