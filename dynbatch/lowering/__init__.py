"""Stage 4: lowering the batched graph through AOTAutograd to kernels.

In: the batched FX graph (stage 2) and the backend's options.
Out: a compiled callable (Inductor's C++ on CPU, Triton on CUDA, or aot_eager),
its aten graph rewritten by dynbatch's passes (aten_passes.py) and recorded, and
``Verified``, the first-call check against eager when the option asks for it.

Never: lower a graph whose trace depends on B's value (B stays symbolic), or keep
a patch of Inductor in place outside one lowering.
"""
