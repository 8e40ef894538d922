"""ImageNet 256x256 class-conditional U-ViT-H/2: imagenet256_uvit_large.py with the H model
and the release's discrete-time recipe.

Against configs/imagenet256_uvit_large.py, the release's configs/imagenet256_uvit_huge.py
changes the network (H: width 1152, depth 28, no final 3x3 conv), the label dropout (0.1),
the steps (500k) and the decoder (autoencoder_kl_ema.pth), and it is trained by
train_ldm_discrete.py (the discrete scaled-linear schedule, n = k + 1) and evaluated by
eval_ldm_discrete.py (dpm_solver_pp.py's fast sampler), with the same guidance 0.4.
"""

from dataclasses import replace

from uvic.config import Config
from uvic.config.models import uvit_size
from uvic.presets import derive


def get_config() -> Config:
    """U-ViT-H/2 on 4x32x32 latents of 256x256 ImageNet, 500k steps of batch 1024."""
    cfg = derive("imagenet256_uvit_large", __file__)
    cfg.model = replace(cfg.model, **uvit_size("huge"))  # U-ViT-H: 500.8M
    cfg.model.conv = False  # the release's conv=False
    cfg.diffusion.schedule = "scaled_linear"
    cfg.diffusion.beta_start, cfg.diffusion.beta_end = 0.00085, 0.012
    cfg.diffusion.num_train_timesteps = 1000
    cfg.diffusion.p_uncond = 0.1
    cfg.train.max_steps = 500_000
    cfg.data.vae = "stabilityai/sd-vae-ft-ema"  # the release's autoencoder_kl_ema.pth
    # eval_ldm_discrete.py: DPM_Solver(predict_x0=True).sample(steps=50, eps=1/N, T=1)
    cfg.sample.scheduler = "dpm_solver++_fast_time_uniform"
    return cfg
