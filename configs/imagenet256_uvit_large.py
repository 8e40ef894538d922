"""ImageNet 256x256 class-conditional U-ViT-L/2 on Stable Diffusion VAE latents.

Model, schedule, optimiser, sampler and FID protocol follow the U-ViT release
(configs/imagenet256_uvit_large.py of baofff/U-ViT, trained by its train_ldm.py: the
continuous-time objective; evaluated by its eval_ldm.py). The data is the latent features
of `uvic-extract-imagenet --resolution 256` (uvic/data/imagenet.py): every training image
and its mirror image. 1000 classes plus the classifier-free null class 1000, put in place of
the label with probability p_uncond = 0.15.
"""

from uvic.config import (
    Config,
    DataConfig,
    DiffusionConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    SampleConfig,
    TrainConfig,
)
from uvic.config.models import uvit_size


def get_config() -> Config:
    """U-ViT-L/2 on 4x32x32 latents of 256x256 ImageNet, 300k steps of batch 1024."""
    return Config(
        name="imagenet256_uvit_large",
        model=ModelConfig(
            img_size=32, in_chans=4, patch_size=2,  # KL-f8 latents of 256x256 images
            **uvit_size("large"), mlp_ratio=4.0,  # U-ViT-L: 21 blocks, 286.8M
            qkv_bias=False, mlp_time_embed=False,
            num_classes=1001, clip_dim=0,  # 1000 classes + the null class (label 1000)
            conv=True, skip=True,
            attention="uvit",
            grad_checkpointing=True,  # the release's use_checkpoint=True
        ),
        data=DataConfig(
            name="imagenet_features", root="data/imagenet256_features",
            random_flip=True,  # the stored mirror images' features: 2 items per image
            scale_factor=0.18215,  # the release's autoencoder default (not MS-COCO's 0.23010)
            # Decoder for samples: the release's autoencoder_kl.pth, Stable Diffusion's own
            # KL-f8 autoencoder. (Features are the encoder's, which sd-vae-ft-ema shares.)
            vae="CompVis/stable-diffusion-v1-4/vae",
        ),
        diffusion=DiffusionConfig(
            schedule="vp_continuous", beta_min=0.1, beta_max=20.0,  # network sees 999 t
            num_train_timesteps=1000,
            p_uncond=0.15,  # label -> the null class, for classifier-free guidance
        ),
        optim=OptimConfig(
            lr=2e-4, betas=(0.99, 0.99), weight_decay=0.03, warmup_steps=5000, grad_clip=0.0,
        ),
        train=TrainConfig(
            output_dir="runs/imagenet256_uvit_large",
            batch_size=1024, max_steps=300_000,
            mixed_precision="fp16",  # the release launches with --mixed_precision fp16
            ema_decay=0.9999, seed=1234,
            log_every=100, sample_every=10_000, ckpt_every=25_000, n_grid=64,
        ),
        sample=SampleConfig(
            # The release's FID protocol (eval_ldm.py, algorithm dpm_solver):
            # dpm_solver_pytorch.py's sample(steps=50, eps=1e-4, fast_version=True) on
            # eps = c + 0.4 (c - u), u the null class's prediction; labels uniform.
            scheduler="dpm_solver_fast_logsnr", steps=50, order=2,
            cfg_scale=0.4,  # the release's scale; diffusers' guidance_scale = 1.4
            batch_size=50, decode_batch_size=50,
        ),
        eval=EvalConfig(
            # The release computes FID with a pytorch-fid port: clean-fid's legacy_pytorch,
            # against its fid_stats_imagenet256_guided_diffusion.npz (ADM's reference batch).
            n_samples=50_000, mode="legacy_pytorch",
            ref_stats="data/fid_stats/fid_stats_imagenet256_guided_diffusion.npz",
            ref_split="train", ref_res=256,
        ),
    )
