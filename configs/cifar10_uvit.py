"""CIFAR-10 unconditional U-ViT-S/2 (softmax attention everywhere).

Model, schedule, optimiser, sampler and FID protocol follow the U-ViT release
(configs/cifar10_uvit_small.py of baofff/U-ViT; docs/conventions.md); the Cog-attention paper trains
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
    """U-ViT-S/2 on 32x32 CIFAR-10 pixels, 500k steps of batch 128."""
    return Config(
        name="cifar10_uvit",
        model=ModelConfig(
            img_size=32, in_chans=3, patch_size=2,
            **uvit_size("small"), mlp_ratio=4.0,  # U-ViT-S: 13 blocks, 44.3M
            qkv_bias=False, mlp_time_embed=False,
            num_classes=-1, clip_dim=0,  # unconditional
            conv=True, skip=True,
            attention="uvit",
        ),
        data=DataConfig(name="cifar10", root="data/cifar10", random_flip=True),
        diffusion=DiffusionConfig(
            schedule="vp_continuous", beta_min=0.1, beta_max=20.0,  # network sees 999 t
            num_train_timesteps=1000,
            p_uncond=0.0,  # no conditioning to drop
        ),
        optim=OptimConfig(
            lr=2e-4, betas=(0.99, 0.999), weight_decay=0.03, warmup_steps=2500, grad_clip=0.0,
        ),
        train=TrainConfig(
            output_dir="runs/cifar10_uvit",
            batch_size=128, max_steps=500_000,
            mixed_precision="fp16",  # the release launches with --mixed_precision fp16
            ema_decay=0.9999, seed=1234,
            log_every=100, sample_every=10_000, ckpt_every=25_000, n_grid=64,
        ),
        sample=SampleConfig(
            # The release's FID protocol: Euler-Maruyama on the reverse VP SDE, 1000 steps,
            # noiseless mean at the last step. Faster (about 20x): --set
            # sample.scheduler=dpm_solver++ --set sample.steps=50 (order 3, logSNR grid).
            scheduler="euler_maruyama", steps=1000, order=3,
            cfg_scale=0.0,  # unconditional: no guidance
            batch_size=500,
        ),
        eval=EvalConfig(
            # The release computes FID with a pytorch-fid port: clean-fid's legacy_pytorch.
            n_samples=50_000, mode="legacy_pytorch",
            ref_stats="cifar10", ref_split="train", ref_res=32,  # clean-fid named statistics
        ),
    )
