"""Model FLOPs of a U-ViT / U-ViC, counted from its config (for MFU in `uvic-bench-train`).

Only matrix products count (2 FLOPs per multiply-add), the usual MFU convention: norms,
activations, attention weights and the optimizer are left out, and a training step is 3x
the forward whatever gradient checkpointing recomputes (`tests/test_bench_train.py` checks
the count against torch's FlopCounterMode).
"""

from __future__ import annotations

from uvic.config import ModelConfig
from uvic.config.models import resolve_attention


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
        flops += 2 * 2 * D * 4 * D  # time MLP, on one token
    if m.clip_dim > 0:
        flops += 2 * m.num_clip_token * m.clip_dim * D  # text tokens
    # per block: qkv, scores Q K^T, weights x V, output projection, the MLP's two layers;
    # differential attention's two maps each weigh values twice as wide (the scores of its
    # h/2 head pairs cost what h heads' do); its second version adds a second query and its
    # map (scores and weights x V) and the lambda projection; an output gate is one more
    # projection
    block = 2 * N * D * 3 * D + 2 * 2 * N * N * D + 2 * N * D * D + 2 * 2 * N * D * hidden
    gate = {"none": 0, "elementwise": D, "headwise": m.num_heads}[m.output_gate]
    for mode in resolve_attention(m.attention, m.depth):
        heads = m.num_heads // 2 if mode == "differential" else m.num_heads
        gate_width = heads if m.output_gate == "headwise" else gate
        flops += block + 2 * N * D * gate_width
        if mode == "differential":
            flops += 2 * N * N * D  # the second weights x V
        elif mode == "differential_v2":
            flops += 2 * N * D * D + 2 * 2 * N * N * D + 2 * N * D * m.num_heads
    if m.skip:
        flops += (m.depth // 2) * 2 * N * 2 * D * D  # each out-block's skip, Linear(2D -> D)
    flops += 2 * N * D * p * p * C  # decoder, on every token before the extras are dropped
    if m.conv:
        flops += 2 * m.img_size * m.img_size * C * C * 9  # final 3x3 convolution
    return flops


def training_flops(m: ModelConfig) -> int:
    """Model FLOPs of one image's training step: forward + backward = 3x the forward."""
    return 3 * forward_flops(m)
