"""ImageNet 512x512 class-conditional U-ViT-L/4: imagenet256_uvit_large.py on 4x64x64 latents.

Against configs/imagenet256_uvit_large.py, the release's configs/imagenet512_uvit_large.py
changes the latents (64x64, from 512x512 crops: `uvic-extract-imagenet --resolution 512`),
the patch size (4, so the same 256 tokens), the steps (500k), the guidance scale (0.7) and
the reference statistics; same continuous-time training (train_ldm.py) and evaluation
(eval_ldm.py).
"""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """U-ViT-L/4 on 4x64x64 latents of 512x512 ImageNet, 500k steps of batch 1024."""
    cfg = derive("imagenet256_uvit_large", __file__)
    cfg.model.img_size, cfg.model.patch_size = 64, 4  # U-ViT-L/4: 286.9M
    cfg.data.root = "data/imagenet512_features"
    cfg.train.max_steps = 500_000
    cfg.sample.cfg_scale = 0.7  # the release's scale; diffusers' guidance_scale = 1.7
    cfg.eval.ref_stats = "data/fid_stats/fid_stats_imagenet512_guided_diffusion.npz"
    cfg.eval.ref_res = 512
    return cfg
