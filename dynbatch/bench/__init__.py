"""The dynbatch benchmark: ``python -m dynbatch.bench`` (or ``dynbatch-bench``).

Times batched backward passes (Jacobians, VJPs, Hessians, HVPs) under every
way PyTorch (and JAX, when installed) offers to batch them, in one process,
and writes ``results.json``, ``results.md`` and PNG plots.  docs/benchmarks.md
explains the columns and figures.

Modules, one concern each:
- problem.py: the Problem/Case/Floor data a workload hands over;
- workloads.py: the functions differentiated, their sizes and floors;
- training.py: the force_training workload, a training step with columns of its own;
- mace_workload.py: the mace workload, a real model (mace-torch) in three calls, columns of its own;
- variants.py: how each column batches a problem (the plumbing);
- measure.py: timing, memory and error of one cell;
- stock.py: the stock torch.compile column, in a subprocess with a time limit;
- runner.py: running every column on every case, with a progress bar;
- report.py / plots.py: results.json, results.md and the PNG figures; the ``report``
  command, which rewrites docs/benchmarks.md's tables and plots from results files;
- cli.py: what the commands share (flags, argument types, core pinning);
- __main__.py: the command line: the run above, or one of the commands
  ``overhead`` (overhead.py: where a small call's time goes), ``ab`` (ab.py: one
  option at several settings, side by side), ``gemm`` (gemm.py: one CPU
  product by each kernel), ``report`` (report.py: the docs' tables),
  ``ab_per_process`` (ab_per_process.py: one case at two settings, each in a fresh
  process), ``outside_floor`` (outside_floor.py: a grad outside a compiled model beside
  torch's own costs), ``hessian_rows`` (hessian_rows.py: the hessian rows through one
  column alone), ``mace_compile`` (mace_compile.py: MACE's compile time) and
  ``first_call`` (first_call.py: a training step's first call, cold and warm, by phase).
"""

from .variants import REFERENCE, VARIANTS
from .workloads import WORKLOADS

__all__ = ["REFERENCE", "VARIANTS", "WORKLOADS"]
