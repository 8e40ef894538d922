"""CPU quickstart: a tiny U-ViT on the built-in coloured-shapes data (minutes on 2 cores).

Same code path as the paper configs (continuous VP schedule as CIFAR-10, AdamW with
warm-up, EMA, diffusers samplers, clean-fid), scaled down; switch to U-ViC with
`--set model.attention=uvic`. The settings that differ from the paper's, and why
(measured on held-out images; see the README's quickstart section):

* 16x16 images in 2x2 patches (64 tokens, as 32x32 in 4x4 patches, so the same cost):
  a 64-wide token must carry 12 noise values instead of 48, and the model's noise
  prediction error at high noise drops about 3x.
* beta_max 10 instead of 20: alpha_bar at t = 1 is 6.4e-3 instead of 4.3e-5, so the
  x0 estimate of the first sampling steps multiplies the noise-prediction error by
  12 instead of 152 (the per-image colour was blown out to saturation before).
* Cosine learning-rate decay to 0 and a short EMA: a 0.998 EMA of weights still moving
  at a constant 1e-3 predicted noise 2x worse than the final weights.
* DDPM's ancestral sampler (50 steps with autoguidance, see below): fresh noise at each
  step lets the model correct its own errors, where the deterministic DPM-Solver++ ODE
  kept them as per-pixel noise.
* A 2D sine-cosine initial position embedding (`model.pos_embed_init="sincos"`, still
  learned) instead of the release's trunc-normal(0.02): in 1500 steps the learned one
  barely moved (mean norm 0.13, the init's 0.16) and stayed unstructured (cosine 0.08
  between neighbouring patches), so attention could not tell neighbours apart and every
  2x2 patch chose its colour on its own (a mosaic). With it, the held-out loss fell from
  0.069 to 0.052 and the samples became plain backgrounds with solid blobs.
* 4 heads of 16 instead of 2 of 32 (held-out loss 0.052 -> 0.051). Without Min-SNR
  (below), a learning rate of 2e-3 with 2000 steps gave U-ViT 0.043 but U-ViC 0.055 with
  mosaics, and 6 minutes.
* Min-SNR-5 loss weighting (`diffusion.min_snr_gamma=5`): the plain noise MSE weighs an
  x0 error by SNR, 16 at t = 0.1 but 0.4 at t = 0.5, where the shapes form; capping the
  weight at 5 moved the training towards those levels. The last 2x2-patch mosaics went
  and the held-out (plain) noise MSE fell from 0.0507 to 0.0495.
* With Min-SNR-5, a learning rate of 2e-3 instead of 1e-3: held-out noise MSE 0.0495 ->
  0.0467 (U-ViT) and 0.0575 -> 0.0503 (U-ViC), samples with a shape 0.32 -> 0.41 and
  0.35 -> 0.48. 3e-3 brought U-ViC's ragged mosaics back (palette share 0.88).
* The rest is training compute: the samples' shapes come with more steps (U-ViT, 256
  samples: 0.54 of them with a shape after 2200 steps, 0.59 after 2800), so the model
  is made cheaper per step and the quickstart trains both models at once, one thread
  each (1.5x the steps of one model at a time on two threads).
* An MLP ratio of 2 instead of 4: 21% less time per step (70.7 vs 89.0 ms on one
  thread), and at 2800 steps samples with a shape 0.70 instead of 0.59 (held-out noise
  MSE 0.0414 vs 0.0404).
* DDPM with 100 steps instead of 200: as good (samples with a shape 0.44 vs 0.38 on 64
  samples), half the sampling time.
* Autoguidance (Karras et al. 2024): eps = g + s (g - b) with b the same run's EMA
  weights at step 1000 (`train.keep_steps` keeps that checkpoint), s = 1. The weaker
  model's errors point where the final one still errs; extrapolating away from them
  turned plain backgrounds into shapes (256 samples, DDPM 100: U-ViT 0.68 -> 0.81 with a
  shape, U-ViC 0.57 -> 0.73; HF ratio 0.85 -> 1.09 and 1.14). An earlier guide (step
  500) or a larger s gave more shapes but rougher edges (HF up to 1.8); step 1500 helped
  less. With it, DDPM 50 steps were as good as 100 (0.81 / 0.77), so sampling costs what
  it did (two models x 50 steps).
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
    """~0.19M-parameter U-ViT (4+1 blocks, width 64) on 16x16 shapes, 2700 steps of 32.

    About 90 ms a step on each of 2 idle CPU cores, both models at once: the whole
    quickstart (two models, training, sampling, scoring) takes ~5 minutes. --preset gpu
    in scripts/quickstart.py trains larger.
    """
    return Config(
        name="quickstart",
        model=ModelConfig(
            img_size=16, in_chans=3, patch_size=2,  # 64 patch tokens + 1 time token
            embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0,  # head dim 16
            qkv_bias=False, mlp_time_embed=False, num_classes=-1, clip_dim=0,
            conv=True, skip=True,
            attention="uvit",
            pos_embed_init="sincos",  # where each patch is, from step 0 (see above)
        ),
        data=DataConfig(name="shapes", root="", random_flip=True, num_images=2048,
                        num_workers=0),
        diffusion=DiffusionConfig(schedule="vp_continuous", beta_min=0.1, beta_max=10.0,
                                  num_train_timesteps=1000, p_uncond=0.0,
                                  min_snr_gamma=5.0),  # weight on mid noise (see above)
        # A tiny model trained briefly tolerates (and needs) a larger learning rate; the
        # cosine decay settles the weights by the last step.
        optim=OptimConfig(lr=2e-3, betas=(0.9, 0.999), weight_decay=0.03, warmup_steps=50,
                          lr_schedule="cosine"),
        train=TrainConfig(
            output_dir="runs/quickstart",
            batch_size=32, max_steps=2700,
            mixed_precision="no",  # CPU
            ema_decay=0.99,  # ~100 steps: the LR has decayed to ~1% of its peak by then
            seed=1234,
            log_every=50, sample_every=0, ckpt_every=500, keep_last=2, n_grid=16,
            keep_steps=(1000,),  # the weaker model of autoguidance (below)
        ),
        sample=SampleConfig(scheduler="DDPMScheduler", steps=50, order=1, cfg_scale=0.0,
                            batch_size=128,
                            # eps = g + 1.0 (g - b), b: the run's own EMA at step 1000
                            autoguidance_scale=1.0,
                            autoguidance_ckpt="checkpoints/step_001000/ema.safetensors"),
        eval=EvalConfig(n_samples=256, mode="clean", ref_stats="shapes", ref_split="train",
                        ref_res=16),
    )
