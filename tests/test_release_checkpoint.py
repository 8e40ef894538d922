"""The README's released-checkpoint check: a `nnet_ema.pth` in the release's format
(a torch.save'd state dict with the release's parameter names), sampled under the release's
CIFAR-10 protocol and scored, at test size (tiny model, stand-in features)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from uvic.config import apply_overrides, load_config
from uvic.data.datasets import save_shapes_folder
from uvic.diffusion.schedule import Diffusion
from uvic.evaluation import fid
from uvic.models.uvit import build_model
from uvic.sampling.generate import generate
from uvic.sampling.images import to_uint8

REPO = Path(__file__).resolve().parents[1]


class Features(nn.Module):
    """Stand-in for Inception: (B, 3, 299, 299) in [0, 255] -> (B, 8)."""

    name = "test8"

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("proj", torch.randn(12, 8, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.adaptive_avg_pool2d(x / 255.0, 2).flatten(1) @ self.proj


def test_released_checkpoint_under_the_release_protocol(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "cifar10_uvit.py", [
        "model.img_size=8", "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
        "model.attention_backend=torch", "sample.steps=20", "sample.batch_size=4",
        f"eval.ref_images={save_shapes_folder(tmp_path / 'ref', 12, size=8)}", "eval.ref_res=8",
    ])
    torch.manual_seed(3)
    fresh = build_model(cfg.model).state_dict()
    state = {k: v + 0.02 * torch.randn_like(v) for k, v in fresh.items()}
    assert {"in_blocks.0.attn.qkv.weight", "decoder_pred.weight"} <= set(state)  # release names
    ckpt = tmp_path / "nnet_ema.pth"
    torch.save(state, ckpt)

    result = fid.evaluate(apply_overrides(cfg, ["eval.n_samples=6"]), ckpt,
                          out_json=tmp_path / "fid" / "release.json",
                          feat_extractor=Features(), stats_dir=tmp_path / "stats",
                          num_workers=0, progress=False)
    p = result["protocol"]
    assert (p["sampler"], p["steps"], p["fid_mode"]) == ("euler_maruyama", 20, "legacy_pytorch")
    assert np.isfinite(result["fid"]) and result["checkpoint"] == str(ckpt)

    # the PNGs are the released weights sampled with Euler-Maruyama, sample i seeded by (0, i)
    model = build_model(cfg.model).eval()
    model.load_state_dict(state)
    (_, images), = generate(model, Diffusion(cfg.diffusion), cfg, [4], seed=0)
    png = np.asarray(Image.open(Path(result["samples_dir"]) / "000004.png"))
    assert np.array_equal(png, to_uint8(images)[0].numpy())
