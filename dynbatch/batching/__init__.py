"""Stage 2 (and 3): the batching pass and the rules it points grad calls at.

In: a Dynamo FX graph whose ``torch.autograd.grad`` calls capture (stage 1) kept.
Out: a copy of that graph whose batched grad calls (``is_grads_batched=True``) call
``batched_grad``: functorch's vmap over the vjp, B symbolic, with ``_make_grads``'
shape checks (stage 3, shape_checks.py) and the markers the memory plan reads.

Never: change the input graph, change a node that is not a grad call, or import a
stage above it (capture installs these rules; it is never imported from here).
"""
