"""MS-COCO 256x256 text-to-image U-ViT-S/2 on Stable Diffusion VAE latents.

Model, schedule, optimiser, sampler and FID protocol follow the U-ViT release
(configs/mscoco_uvit_small.py of baofff/U-ViT; docs/conventions.md); the Cog-attention paper trains
and evaluates U-ViC with the same recipe. Where we differ from the release, the README's
"Fidelity" section says so.
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
    """U-ViT-S/2 on 4x32x32 latents with 77 CLIP ViT-L/14 text tokens, 1M steps of 256."""
    return Config(
        name="mscoco_uvit",
        model=ModelConfig(
            img_size=32, in_chans=4, patch_size=2,  # KL-f8 latents of 256x256 images
            **uvit_size("small"), mlp_ratio=4.0,  # U-ViT-S: 13 blocks, 44.7M
            qkv_bias=False, mlp_time_embed=False,
            num_classes=-1, clip_dim=768, num_clip_token=77,
            conv=True, skip=True,
            attention="uvit",
        ),
        data=DataConfig(
            name="mscoco", root="data/mscoco_features", random_flip=False,
            scale_factor=0.23010,  # the release's autoencoder scale_factor for MS-COCO
            # The release's autoencoder_kl.pth, Stable Diffusion's own KL-f8 autoencoder, both
            # for the features and for decoding samples (docs/conventions.md, "Autoencoders").
            vae="CompVis/stable-diffusion-v1-4/vae",
            clip_model="ViT-L-14-quickgelu", clip_pretrained="openai",
        ),
        diffusion=DiffusionConfig(
            schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
            num_train_timesteps=1000,  # network sees n = k + 1
            p_uncond=0.1,  # caption -> empty-prompt context, for classifier-free guidance
        ),
        optim=OptimConfig(
            lr=2e-4, betas=(0.9, 0.9), weight_decay=0.03, warmup_steps=5000, grad_clip=0.0,
        ),
        train=TrainConfig(
            output_dir="runs/mscoco_uvit",
            batch_size=256, max_steps=1_000_000,
            mixed_precision="fp16",  # the release launches with --mixed_precision fp16
            ema_decay=0.9999, seed=1234,
            log_every=100, sample_every=10_000, ckpt_every=25_000, n_grid=64,
        ),
        sample=SampleConfig(
            # The release's FID protocol (eval_t2i_discrete.py): dpm_solver_pp.py's
            # DPM_Solver(predict_x0=True).sample(steps=50, eps=1/N, T=1), method "fast".
            # Ours instead: --set sample.scheduler=dpm_solver++ --set sample.order=2.
            scheduler="dpm_solver++_fast_time_uniform", steps=50, order=2,
            cfg_scale=1.0,  # eps = c + 1.0 (c - u)
            batch_size=50, decode_batch_size=50,
        ),
        eval=EvalConfig(
            # The release computes FID with a pytorch-fid port: clean-fid's legacy_pytorch.
            n_samples=30_000, mode="legacy_pytorch",
            # Custom statistics of val2014 at 256x256 (center crop, resize), built once
            # from `ref_images`; prompts are drawn from the val caption features.
            ref_stats="data/fid_stats/mscoco_val2014_256.npz", ref_split="val", ref_res=256,
            ref_images="data/coco/val2014",
            captions="data/mscoco_features/val",
        ),
    )
