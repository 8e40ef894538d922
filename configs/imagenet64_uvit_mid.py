"""ImageNet 64x64 class-conditional U-ViT-M/4 (softmax attention everywhere).

Model, schedule, optimiser, sampler and FID protocol follow the U-ViT release
(configs/imagenet64_uvit_mid.py of baofff/U-ViT, trained by its train.py, evaluated by its
eval.py); the data is ILSVRC-2012 train in class folders with the release's crop and flip
(uvic/data/imagenet.py). 1000 classes, no null class: the release trains this row without
classifier-free guidance.
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
    """U-ViT-M/4 on 64x64 ImageNet pixels, 300k steps of batch 1024."""
    return Config(
        name="imagenet64_uvit_mid",
        model=ModelConfig(
            img_size=64, in_chans=3, patch_size=4,
            **uvit_size("mid"), mlp_ratio=4.0,  # U-ViT-M: 17 blocks, 130.9M
            qkv_bias=False, mlp_time_embed=False,
            num_classes=1000, clip_dim=0,  # label token, 1000 classes (no null class)
            conv=True, skip=True,
            attention="uvit",
            grad_checkpointing=True,  # the release's use_checkpoint=True
        ),
        data=DataConfig(name="imagenet", root="data/imagenet", random_flip=True),
        diffusion=DiffusionConfig(
            schedule="vp_continuous", beta_min=0.1, beta_max=20.0,  # network sees 999 t
            num_train_timesteps=1000,
            p_uncond=0.0,  # labels are never dropped
        ),
        optim=OptimConfig(
            lr=3e-4, betas=(0.99, 0.99), weight_decay=0.03, warmup_steps=5000, grad_clip=0.0,
        ),
        train=TrainConfig(
            output_dir="runs/imagenet64_uvit_mid",
            batch_size=1024, max_steps=300_000,
            mixed_precision="fp16",  # the release launches with --mixed_precision fp16
            ema_decay=0.9999, seed=1234,
            log_every=100, sample_every=10_000, ckpt_every=25_000, n_grid=64,
        ),
        sample=SampleConfig(
            # The release's FID protocol (eval.py, algorithm dpm_solver): dpm_solver_pytorch.py's
            # sample(steps=50, eps=1e-4, fast_version=True), no guidance; labels drawn in
            # proportion to the train set's class counts.
            scheduler="dpm_solver_fast_logsnr", steps=50, order=3,
            cfg_scale=0.0,  # no guidance (and no null class to guide with)
            batch_size=200,
        ),
        eval=EvalConfig(
            # The release computes FID with a pytorch-fid port: clean-fid's legacy_pytorch,
            # against its fid_stats_imagenet64_guided_diffusion.npz (ADM's reference batch).
            n_samples=50_000, mode="legacy_pytorch",
            ref_stats="data/fid_stats/fid_stats_imagenet64_guided_diffusion.npz",
            ref_split="train", ref_res=64,
        ),
    )
