"""ImageNet 256x256 class-conditional U-ViT-H/2: imagenet256_uvit_large.py with the H model
and the release's discrete-time recipe.

Against configs/imagenet256_uvit_large.py, the release's configs/imagenet256_uvit_huge.py
changes the network (H: width 1152, depth 28, no final 3x3 conv), the label dropout (0.1),
the steps (500k) and the decoder (autoencoder_kl_ema.pth), and it is trained by
train_ldm_discrete.py (the discrete scaled-linear schedule, n = k + 1) and evaluated by
eval_ldm_discrete.py (dpm_solver_pp.py's fast sampler), with the same guidance 0.4.
"""

from pathlib import Path

from uvic.config import Config, load_config
from uvic.config.models import size_overrides


def get_config() -> Config:
    """U-ViT-H/2 on 4x32x32 latents of 256x256 ImageNet, 500k steps of batch 1024."""
    return load_config(Path(__file__).with_name("imagenet256_uvit_large.py"), [
        *size_overrides("huge"),  # U-ViT-H: 500.8M
        "model.conv=false",  # the release's conv=False
        "diffusion.schedule=scaled_linear", "diffusion.beta_start=0.00085",
        "diffusion.beta_end=0.012", "diffusion.num_train_timesteps=1000",
        "diffusion.p_uncond=0.1",
        "train.max_steps=500000",
        "data.vae=stabilityai/sd-vae-ft-ema",  # the release's autoencoder_kl_ema.pth
        # eval_ldm_discrete.py: DPM_Solver(predict_x0=True).sample(steps=50, eps=1/N, T=1)
        "sample.scheduler=dpm_solver++_fast_time_uniform",
        "name=imagenet256_uvit_huge", "train.output_dir=runs/imagenet256_uvit_huge",
    ])
