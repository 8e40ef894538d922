"""Model FLOPs of a U-ViT / U-ViC, counted from its config (for MFU in `uvic-bench-train`).

Only the matrix products count (2 FLOPs per multiply-add), as in the usual MFU
convention; norms, activations, softmax/Cog weights and the optimizer are left out. Per
image, with N tokens (patches plus time, label or text tokens), width D, MLP hidden H,
depth + 1 blocks:

* patch embedding (a p x p convolution, stride p): 2 L (C p^2) D;
* time MLP (model.mlp_time_embed): 2 (4 D^2 + 4 D^2) on one token; text tokens:
  2 T clip_dim D;
* per block: qkv 2 N D 3D, scores Q K^T 2 N^2 D, weights x V 2 N^2 D, output projection
  2 N D^2, MLP 2 N D H x 2; each out-block's long skip, Linear(2D -> D): 2 N 2D D;
* decoder (Linear(D -> p^2 C), on every token before the extra ones are dropped):
  2 N D p^2 C; final 3x3 convolution (model.conv): 2 H W C^2 9.

A training step is 3x the forward (backward = 2x forward), whatever recomputation
gradient checkpointing adds (MFU counts the model's FLOPs, not the hardware's).
`tests/test_bench_train.py` checks the count against torch's FlopCounterMode.
"""

from __future__ import annotations

from uvic.config import ModelConfig


def num_tokens(m: ModelConfig) -> int:
    """Sequence length the attention sees: patches, time token, label or text tokens."""
    extras = 1 + (m.num_classes > 0) + (m.num_clip_token if m.clip_dim > 0 else 0)
    return (m.img_size // m.patch_size) ** 2 + extras


def forward_flops(m: ModelConfig) -> int:
    """Matmul FLOPs of one image's forward pass through the model of `m`."""
    D, C, p = m.embed_dim, m.in_chans, m.patch_size
    N, L, hidden = num_tokens(m), (m.img_size // p) ** 2, int(D * m.mlp_ratio)
    flops = 2 * L * C * p * p * D  # patch embedding
    if m.mlp_time_embed:
        flops += 2 * 2 * D * 4 * D
    if m.clip_dim > 0:
        flops += 2 * m.num_clip_token * m.clip_dim * D
    block = 2 * N * D * 3 * D + 2 * 2 * N * N * D + 2 * N * D * D + 2 * 2 * N * D * hidden
    flops += (m.depth + 1) * block
    if m.skip:
        flops += (m.depth // 2) * 2 * N * 2 * D * D
    flops += 2 * N * D * p * p * C  # decoder
    if m.conv:
        flops += 2 * m.img_size * m.img_size * C * C * 9
    return flops


def training_flops(m: ModelConfig) -> int:
    """Model FLOPs of one image's training step: forward + backward = 3x the forward."""
    return 3 * forward_flops(m)
