"""The quickstart's larger run on a GPU (`uvic-quickstart --preset gpu`, and `auto` where
CUDA is available): configs/quickstart.py wider and deeper, on more images for longer, in
bf16. Autoguidance was tuned on the CPU run (its guide at step 1000 of 2700) and is not
measured here, so this run samples unguided with DDPM's 100 steps.
"""

from dataclasses import replace

from uvic.config import Config, load_config
from uvic.presets import preset_path


def get_config() -> Config:
    """configs/quickstart.py at width 256, depth 8, 4 heads; 20k steps of 128 images."""
    cpu = load_config(preset_path("quickstart"))
    return replace(
        cpu,
        # an MLP ratio of 4, the usual one (the CPU run's 2 saves CPU time)
        model=replace(cpu.model, embed_dim=256, depth=8, num_heads=4, mlp_ratio=4),
        data=replace(cpu.data, num_images=50_000, num_workers=4),
        optim=replace(cpu.optim, lr=4e-4, warmup_steps=1000),
        train=replace(cpu.train, batch_size=128, max_steps=20_000, mixed_precision="bf16",
                      ema_decay=0.9995, log_every=100, sample_every=5000, ckpt_every=5000,
                      keep_steps=()),
        sample=replace(cpu.sample, autoguidance_scale=0.0, steps=100),
        eval=replace(cpu.eval, n_samples=10_000),
    )
