"""ImageNet 256x256 U-ViT-L/2 under the modern recipe: flow matching, REPA, guidance interval.

The network, data and FID protocol are imagenet256_uvit_large.py's; what changes is the
recipe, with its numbers taken from two papers:

* Yu et al. 2024, "Representation Alignment for Generation" (REPA), for SiT-XL/2 on
  ImageNet 256 (its training command and sampler defaults): the linear interpolant with
  velocity prediction and uniform times; REPA on the output of block 8 (of 28) aligned
  with DINOv2 ViT-B/14 patch features at weight 0.5 (projector of width 2,048); AdamW at
  a constant 1e-4 (no warm-up) with betas (0.9, 0.999), no weight decay, gradient
  clipping at 1.0; batch 256, 400k steps, fp16, labels dropped with probability 0.1;
  sampled with the SDE (Euler-Maruyama) in 250 steps and classifier-free guidance 1.8
  (diffusers' scale, v = u + 1.8 (c - u); here cfg_scale = 0.8 of v = c + s (c - u))
  applied only at t <= 0.7 (t = 1 is noise), that is at noise levels
  sigma = t / (1 - t) up to 7/3.
* Yao et al. 2025, "Reconstruction vs. Generation: Taming Optimization Dilemma in Latent
  Diffusion Models" (LightningDiT): timesteps drawn logit-normal, t = sigmoid(n) with
  n ~ N(0, 1), in place of REPA's uniform times (symmetric about t = 1/2, so the same
  whichever end of the path is noise).

U-ViT-L/2 has 21 blocks (10 in-blocks, the mid-block, 10 out-blocks) where SiT-XL/2 has
28; REPA aligns the output of the 8th block, 2/7 of the depth, and the output of the 6th
block of U-ViT-L (the sixth in-block) is exactly 2/7: train.repa_block = 5 (0-based).

The data: ImageNet-256 latents extracted WITH the encoder's features, in their own folder
(a folder extracted without them is refused by the extractor, its settings differ):

    uvic-extract-imagenet --imagenet data/imagenet --out data/imagenet256_features_repa \
        --resolution 256 --repa-encoder vit_base_patch14_dinov2.lvd142m

(16 x 16 features of width 768 per image, the model's token grid; about 500 GB in
float16 beside the 84 GB of latents). A run on latents without them stops at start in one
line: `train.repa_encoder: data.root=<folder> holds latents without REPA encoder
features; extract them with uvic-extract-imagenet --out <folder> --repa-encoder
vit_base_patch14_dinov2.lvd142m --repa-grid 16`. Without the features (or the encoder),
`--set train.repa_encoder= --set data.root=data/imagenet256_features` trains the rest of
the recipe on the release's plain latents.

What stays imagenet256_uvit_large's: the network (U-ViT-L/2, 286.8M, on 4x32x32 latents),
the null class 1000, the EMA (0.9999, as REPA), the decoder and the FID protocol (50k
samples, the release's pytorch-fid port against ADM's reference statistics; REPA reports
ADM's TensorFlow evaluator). `uvic-recipes-table --dry-run` states its compute.
"""

from uvic.config import Config
from uvic.presets import derive


def get_config() -> Config:
    """imagenet256_uvit_large with flow matching, REPA and the guidance interval: only the
    recipe (objective, times, REPA, optimiser, length, sampler) and data folder differ."""
    cfg = derive("imagenet256_uvit_large", __file__)
    # flow matching: REPA's path and prediction; LightningDiT's logit-normal times
    d = cfg.diffusion
    d.objective, d.interpolant = "velocity", "linear"
    d.timestep_sampling = "logit_normal"
    d.logit_normal_mean, d.logit_normal_std = 0.0, 1.0
    d.p_uncond = 0.1  # REPA's cfg-prob (the release: 0.15)
    # REPA: DINOv2 ViT-B/14 (timm's name; the Hugging Face cache or hub, or
    # --set train.repa_encoder_weights=dinov2_vitb14_pretrain.pth), features stored with
    # the latents; the sixth in-block's output (index 5 of 0..20); REPA's weight, projector
    t = cfg.train
    t.repa_encoder = "vit_base_patch14_dinov2.lvd142m"
    t.repa_block, t.repa_weight, t.repa_projector_dim = 5, 0.5, 2048
    cfg.data.root = "data/imagenet256_features_repa"
    # REPA's optimiser: constant 1e-4, no warm-up, no weight decay, clipping at 1.0
    o = cfg.optim
    o.lr, o.betas, o.weight_decay = 1e-4, (0.9, 0.999), 0.0
    o.warmup_steps, o.grad_clip, o.lr_schedule = 0, 1.0, "constant"
    t.batch_size, t.max_steps = 256, 400_000  # REPA's 400k steps of 256
    # REPA's sampler: the SDE in 250 steps, guidance 1.8 (diffusers') on t <= 0.7 only
    s = cfg.sample
    s.scheduler, s.steps, s.cfg_scale = "flow_euler_maruyama", 250, 0.8
    s.guidance_interval = (0.0, 7 / 3)
    return cfg
