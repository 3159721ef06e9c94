"""The edge of the compiled region: what a grad taken outside a dynbatch graph gets.

In: a compiled graph (stage 4's callable) and the Dynamo graph it came from.
Out: a ``Region`` that Dynamo calls in the graph's place; a backward that reaches it
from outside (plain, batched, ``create_graph``, under ``torch.vmap``) runs one
compiled program chosen by what the request is (docs/design.md, "The edge of the
region"), compiled on its first call and reused after.

Never: return a grad eager would not (a path that cannot answer falls back to an
eager re-run, logged), or depend on the stages' internals beyond their interfaces.
"""
