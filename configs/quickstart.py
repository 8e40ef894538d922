"""CPU quickstart: a tiny U-ViT on the built-in coloured-shapes data (minutes on 2 cores).

Same code path as the paper configs (continuous VP schedule as CIFAR-10, AdamW with
warm-up, EMA, DPM-Solver++ sampling, clean-fid), scaled down; switch to U-ViC with
`--set model.attention=uvic`.
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


def get_config() -> Config:
    """~0.28M-parameter U-ViT (4+1 blocks, width 64) on 32x32 shapes, 1500 steps of 32.

    About 75 ms a step on 2 CPU cores: the whole quickstart (two models) takes ~5 minutes.
    That is enough to see shapes emerge and to compare the two losses, not for clean
    samples: a model this small and short still leaves noise (scripts/quickstart.py
    --preset gpu trains larger)."""
    return Config(
        name="quickstart",
        model=ModelConfig(
            img_size=32, in_chans=3, patch_size=4,  # 64 patch tokens + 1 time token
            embed_dim=64, depth=4, num_heads=2, mlp_ratio=4.0,  # head dim 32
            qkv_bias=False, mlp_time_embed=False, num_classes=-1, clip_dim=0,
            conv=True, skip=True,
            attention="uvit",
        ),
        data=DataConfig(name="shapes", root="", random_flip=True, num_images=2048,
                        num_workers=0),
        diffusion=DiffusionConfig(schedule="vp_continuous", beta_min=0.1, beta_max=20.0,
                                  num_train_timesteps=1000, p_uncond=0.0),
        # A tiny model trained briefly tolerates (and needs) a larger learning rate.
        optim=OptimConfig(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.03, warmup_steps=50),
        train=TrainConfig(
            output_dir="runs/quickstart",
            batch_size=32, max_steps=1500,
            mixed_precision="no",  # CPU
            ema_decay=0.998,  # averages over ~500 steps: a 0.9999 EMA would barely move in 1500
            seed=1234,
            log_every=50, sample_every=500, ckpt_every=500, keep_last=2, n_grid=16,
        ),
        sample=SampleConfig(scheduler="dpm_solver++", steps=25, order=3, cfg_scale=0.0,
                            batch_size=64),
        eval=EvalConfig(n_samples=256, mode="clean", ref_stats="shapes", ref_split="train",
                        ref_res=32),
    )
