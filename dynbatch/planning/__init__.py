"""Memory within a budget, and what to store: plans over the traced aten graph.

In: the aten graph AOTAutograd traced from the batched graph, with the batching
rule's markers around each batched backward.
Out: a plan per batched grad (fused, or chunks of B within the budget; memory.py,
chunking.py), and the store-or-recompute rewrite stage 4 runs (recompute.py).

Never: change a value.  A plan that would need a new guard on the sizes, or a chunk
that a write in place could reach, is refused and the fused program runs instead.
"""
