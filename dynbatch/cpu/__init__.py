"""CPU kernels under stage 4: the product routing, dynbatch's own GEMM, kept buffers.

In: the products and large intermediates of a lowered CPU program.
Out: each product on the fastest kernel measured for its shape (matmul_kernels.py,
native_gemm.py with its C source in csrc/), and large buffers kept between calls
(kept_buffers.py).

Never: import a stage; a kernel that cannot be built or loaded leaves the product
to ATen.
"""
