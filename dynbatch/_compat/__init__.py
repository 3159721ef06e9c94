"""Version shims and thin wrappers over private torch APIs, one module per torch subsystem.

Dynamo, AOTAutograd, functorch and Inductor internals move between releases;
the stages reach them through the small functions here, as ``_compat.name`` (every
subsystem's names are re-exported below, so a caller needs not know which module
holds one).  Stage logic stays in its stage (a stage module that patches torch
internals itself says so), and a hook that fails turns one feature off
(fail_soft.py).  Tested: torch 2.11 - 2.14.

- dynamo.py: config, variables, exceptions, the backend registry
- aot_autograd.py: config, the compiled node's saved state
- functorch.py: torch.func's transforms and eager's legacy vmap
- inductor.py: config, compile entry points, lowerings, extern kernels
- autograd.py: the engine, functional's helpers, forward AD, schemas, storages
- shapes.py: symbolic shapes, fake tensors, guards, FX

Each module's docstring names its version shims, whose docstrings say which torch takes which
branch and what retires it; its other names wrap private APIs alike on 2.11-2.14.

Only shims and wrappers, each hiding one private API or version difference; logic
built on them lives with the part it serves (region/aot_node.py, capture/fake_cuda_guard.py;
the Inductor scheduler fix in lowering/inductor.py, a late lowering's fakes and guard check in
planning/memory.py, the count of a fake run's unbacked sizes in capture/grad_calls.py).
"""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

from .. import fail_soft


# --- versions --------------------------------------------------------------------

TORCH_VERSION = TorchVersion(torch.__version__)

# Half-open range of the releases dynbatch is tested on.  Others install and run
# (pyproject.toml has no upper bound); dynbatch warns once at first use, and a
# hook whose internals moved turns itself off (``fail_soft.hook_failed``).  TorchVersion
# compares numerically, so "2.9" < "2.11" holds.
MIN_TORCH, MAX_TORCH = "2.11", "2.15"

# Version shim: Dynamo traces Tensor.requires_grad_() on an intermediate from 2.12 on (2.12-2.14's
# _dynamo/variables/tensor.py method_requires_grad_); 2.11 always graph-breaks on it, which also
# affects torch.autograd.functional.jacobian/hessian.  Retire when 2.11 is dropped.
DYNAMO_TRACES_REQUIRES_GRAD_ = TORCH_VERSION >= "2.12"


def torch_is_supported() -> bool:
    return MIN_TORCH <= TORCH_VERSION < MAX_TORCH


def warn_once_if_untested() -> None:
    """At a backend's first compile (not at import: importing is not using)."""
    if not torch_is_supported():
        fail_soft.warn_once("version", f"dynbatch is tested on torch {MIN_TORCH} up to (not including) "
                                       f"{MAX_TORCH}, not {TORCH_VERSION}; a feature whose torch internals "
                                       "changed turns itself off with a warning")


# The subsystems, after the versions they read (``from . import TORCH_VERSION``).
from .aot_autograd import *  # noqa: E402,F403
from .autograd import *  # noqa: E402,F403
from .dynamo import *  # noqa: E402,F403
from .functorch import *  # noqa: E402,F403
from .inductor import *  # noqa: E402,F403
from .shapes import *  # noqa: E402,F403
