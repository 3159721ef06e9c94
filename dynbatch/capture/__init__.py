"""Stage 1: capture ``torch.autograd.grad`` calls into the Dynamo graph.

In: the user's frame, traced by Dynamo while ``capture_scope`` is entered.
Out: one FX graph holding each grad call as a node (its fake run done with the
batching rules below), ``requires_grad_()`` traced, and nodes it could not trace
marked with ``TRACE_ERROR`` / ``UNSUPPORTED`` (batching/grad_pass.py) for the pass
to report.

Never: rewrite the graph (that is the pass's), or leave a patch of Dynamo in place
outside the scope.  A patch that cannot be installed turns one feature off
(fail_soft), it does not fail the compile.
"""
