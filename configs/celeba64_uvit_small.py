"""CelebA 64x64 unconditional U-ViT-S/4 (softmax attention everywhere).

Model, schedule, optimiser, sampler and FID protocol follow the U-ViT release
(configs/celeba64_uvit_small.py of baofff/U-ViT, trained by its train.py); the data is
CelebA's train partition with the release's crop (uvic/data/celeba.py).
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
    """U-ViT-S/4 on 64x64 CelebA pixels, 500k steps of batch 128."""
    return Config(
        name="celeba64_uvit_small",
        model=ModelConfig(
            img_size=64, in_chans=3, patch_size=4,
            **uvit_size("small"), mlp_ratio=4.0,  # U-ViT-S: 13 blocks, 44.3M
            qkv_bias=False, mlp_time_embed=False,
            num_classes=-1, clip_dim=0,  # unconditional
            conv=True, skip=True,
            attention="uvit",
            grad_checkpointing=False,  # the release's config has no use_checkpoint
        ),
        data=DataConfig(name="celeba", root="data/celeba", random_flip=True),
        diffusion=DiffusionConfig(
            schedule="vp_continuous", beta_min=0.1, beta_max=20.0,  # network sees 999 t
            num_train_timesteps=1000,
            p_uncond=0.0,  # no conditioning to drop
        ),
        optim=OptimConfig(
            lr=2e-4, betas=(0.99, 0.99), weight_decay=0.03, warmup_steps=5000, grad_clip=0.0,
        ),
        train=TrainConfig(
            output_dir="runs/celeba64_uvit_small",
            batch_size=128, max_steps=500_000,
            mixed_precision="fp16",  # the release launches with --mixed_precision fp16
            ema_decay=0.9999, seed=1234,
            log_every=100, sample_every=10_000, ckpt_every=25_000, n_grid=64,
        ),
        sample=SampleConfig(
            # The release's FID protocol (eval.py, algorithm euler_maruyama_sde): Euler-Maruyama
            # on the reverse VP SDE, 1000 steps.
            scheduler="euler_maruyama", steps=1000, order=3,
            cfg_scale=0.0,  # unconditional: no guidance
            batch_size=500,
        ),
        eval=EvalConfig(
            # The release computes FID with a pytorch-fid port: clean-fid's legacy_pytorch,
            # against its fid_stats_celeba64_train_50000_ddim.npz (50k train crops).
            n_samples=50_000, mode="legacy_pytorch",
            ref_stats="data/fid_stats/fid_stats_celeba64_train_50000_ddim.npz",
            ref_split="train", ref_res=64,
        ),
    )
