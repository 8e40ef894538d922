"""Table 3's chain at smoke size (`scripts/reproduce_table3.py --smoke`): CPU, about 10 s.

A tiny U-ViT on 16x16 images of the built-in Shapes data, trained for 40 steps, then scored
under a miniature of the CIFAR-10 protocol (Euler-Maruyama, fewer steps and samples) with
the download-free stand-in features (eval.features=projection) instead of Inception. The
numbers mean nothing; the chain (train, FID, table, resuming at each stage) is what it
checks. The U-ViC run adds `model.attention=uvic`; both runs' samples come out nearly
identical (same initial weights, data and noise, 40 steps), so their numbers agree, as the
smoke's table says.
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
    """~40k-parameter U-ViT (2+1 blocks, width 32) on 16x16 shapes, 40 steps of 8."""
    return Config(
        name="table3_smoke",
        model=ModelConfig(img_size=16, in_chans=3, patch_size=4, embed_dim=32, depth=2,
                          num_heads=2, attention="uvit", attention_backend="torch"),
        data=DataConfig(name="shapes", root="", random_flip=True, num_images=64, num_workers=0),
        diffusion=DiffusionConfig(schedule="vp_continuous", beta_min=0.1, beta_max=20.0,
                                  p_uncond=0.0),
        optim=OptimConfig(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.03, warmup_steps=5),
        train=TrainConfig(output_dir="runs/table3_smoke", batch_size=8, max_steps=40,
                          mixed_precision="no", ema_decay=0.9, seed=1234, log_every=10,
                          sample_every=0, ckpt_every=20, keep_last=1, n_grid=4),
        sample=SampleConfig(scheduler="euler_maruyama", steps=20, cfg_scale=0.0,
                            batch_size=32),
        eval=EvalConfig(n_samples=32, mode="clean", ref_stats="shapes", ref_split="train",
                        ref_res=16, features="projection"),
    )
