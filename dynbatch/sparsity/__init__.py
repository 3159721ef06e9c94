"""Sparse Hessians and Jacobians at the cost of their structure (stage: structure).

In: a function, the input its Hessian or Jacobian is taken with respect to, and the
call's other arguments (neighbour lists and other index tensors are data).  Out: the
dense result ``torch.autograd.functional`` gives, or a CSR tensor.  Three steps, one
module each: ``pattern`` (which inputs each output element depends on, propagated
through the call's aten graph, a superset always), ``colouring`` (columns that can share
one product), ``compressed`` (one batched grad per colour through dynbatch's compiled
batched backward, then decompression).  Never returns a value the pattern could not
vouch for: a colouring whose decompression is not unique falls back to dense rows.
"""
