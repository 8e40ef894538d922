"""The quickstart's larger run on a GPU (`uvic-quickstart --preset gpu`, and `auto` where
CUDA is available): configs/quickstart.py wider and deeper, on more images for longer, in
bf16. Autoguidance was tuned on the CPU run (its guide at step 1000 of 2700) and is not
measured here, so this run samples unguided with DDPM's 100 steps.
"""

from uvic.config import Config, load_config
from uvic.presets import preset_path


def get_config() -> Config:
    """configs/quickstart.py at width 256, depth 8, 4 heads; 20k steps of 128 images."""
    cfg = load_config(preset_path("quickstart"))
    m = cfg.model
    # an MLP ratio of 4, the usual one (the CPU run's 2 saves CPU time)
    m.embed_dim, m.depth, m.num_heads, m.mlp_ratio = 256, 8, 4, 4.0
    cfg.data.num_images, cfg.data.num_workers = 50_000, 4
    cfg.optim.lr, cfg.optim.warmup_steps = 4e-4, 1000
    t = cfg.train
    t.batch_size, t.max_steps, t.mixed_precision = 128, 20_000, "bf16"
    t.ema_decay, t.keep_steps = 0.9995, ()
    t.log_every, t.sample_every, t.ckpt_every = 100, 5000, 5000
    cfg.sample.autoguidance_scale, cfg.sample.steps = 0.0, 100
    cfg.eval.n_samples = 10_000
    return cfg
