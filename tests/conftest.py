"""Session-wide pytest setup.

Triton decides between compiling and interpreting when a kernel is defined, so the
choice must be made before any test module imports triton or uvic_kernels: without
CUDA, kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1); with CUDA they
are compiled.  An explicit TRITON_INTERPRET in the environment is kept.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
