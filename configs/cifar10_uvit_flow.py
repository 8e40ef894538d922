"""CIFAR-10 unconditional U-ViT-S/2 trained by flow matching (the modern recipes).

cifar10_uvit.py (model, data, optimiser, length, FID protocol: the U-ViT release's) with the
objective changed, as SiT and REPA train: the network predicts the velocity v = e - x0 of the
linear interpolant x_t = (1 - t) x0 + t e (`uvic.diffusion.flow`).

* Times: uniform t ~ U(0, 1), SiT's and REPA's choice and that of flow matching on CIFAR-10
  (Lipman et al. 2023); logit-normal times (SD3, LightningDiT) concentrate training on
  the middle noise levels of large latent images and are one override away:
  `--set diffusion.timestep_sampling=logit_normal` (mean 0, std 1 by default).
* Sampler: Heun on dx/dt = v, 50 steps from t = 1 to 0 (99 network calls, the last step
  Euler), a tenth of the release's 1000-step Euler-Maruyama; `flow_euler` (50 calls) and
  `flow_euler_maruyama` (the SDE, REPA's default) are the alternatives.
"""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """cifar10_uvit with flow matching: only the objective and the sampler differ."""
    cfg = derive("cifar10_uvit", __file__)
    cfg.diffusion.objective = "velocity"
    cfg.diffusion.interpolant = "linear"
    cfg.diffusion.timestep_sampling = "uniform"
    cfg.sample.scheduler = "flow_heun"
    cfg.sample.steps = 50
    return cfg
