"""The config schema: one dataclass per section and `Config`, which holds them all.

Each field's comment says what it means; the rules on its values live beside this module
(`uvic.config.models`, `.data`, `.diffusion`, ...). Imported through `uvic.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ModelConfig:
    """U-ViT / U-ViC architecture (names follow the U-ViT release)."""

    img_size: int = 32  # spatial size of the network input (pixels or latents)
    in_chans: int = 3
    patch_size: int = 2
    embed_dim: int = 512
    depth: int = 12
    num_heads: int = 8
    mlp_ratio: float = 4.0
    qkv_bias: bool = False
    mlp_time_embed: bool = False
    num_classes: int = -1  # > 0: class-conditional (label token); -1: none
    clip_dim: int = 0  # > 0: text-conditional with `num_clip_token` context tokens
    num_clip_token: int = 77
    conv: bool = True  # final 3x3 conv after unpatchify
    skip: bool = True  # long skips
    # Per-block attention: preset "uvit" (all softmax), "uvic" / "uvie" / "uvis" (cog /
    # expressive / sigmoid except in the first in-block and the last out-block), or a list
    # of depth + 1 modes ("softmax,cog,...": in_blocks, mid_block, out_blocks).
    attention: str = "uvit"
    attention_backend: str = "auto"  # auto | triton | torch | sdpa (softmax blocks only)
    grad_checkpointing: bool = False
    # Initial position embedding of the patch tokens (a learned parameter either way):
    # "normal" = trunc-normal(0.02), the release's; "sincos" = 2D sine-cosine code, for
    # runs too short to learn where patches are (the CPU quickstart).
    pos_embed_init: str = "normal"
    sigmoid_bias: float | None = None  # b of sigmoid(q.k / sqrt(d) + b); None: -log N tokens
    sigmoid_bias_learnable: bool = False  # one b per head and sigmoid block, learned from it
    # Y * sigmoid(X W_g + b) on every block's heads before the output projection: "none",
    # "elementwise" (one gate per channel) or "headwise" (one per head); any attention design
    output_gate: str = "none"
    # differential attention's lambda_init; None: 0.8 - 0.6 exp(-0.3 (l - 1)) in block l
    diff_lambda_init: float | None = None


@dataclass(slots=True)
class DataConfig:
    """Which data the model learns and where it lives on disk."""

    name: str = "cifar10"  # cifar10 | mscoco | shapes | imagenet | imagenet_features | celeba
    # cifar10: torchvision root; mscoco, imagenet_features: feature folder; imagenet: the
    # ILSVRC-2012 root (train/<wnid>/*.JPEG); celeba: the folder of img_align_celeba/
    root: str = "data/cifar10"
    download: bool = False  # cifar10 only: let torchvision download it
    random_flip: bool = True
    num_workers: int = 4
    # shapes (the built-in quickstart dataset): number of images and generator seed
    num_images: int = 2048
    # latent scale factor of the Stable Diffusion KL-f8 VAE (the release's: mscoco 0.23010,
    # imagenet_features 0.18215)
    scale_factor: float = 0.23010
    # hub name, diffusers folder or LDM weights file (uvic.models.autoencoder.load_vae);
    # the default is the release's autoencoder_kl.pth (uvic.models.autoencoder.DEFAULT_VAE)
    vae: str = "CompVis/stable-diffusion-v1-4/vae"
    clip_model: str = "ViT-L-14-quickgelu"  # open_clip model name
    clip_pretrained: str = "openai"  # open_clip tag or a local checkpoint path


@dataclass(slots=True)
class DiffusionConfig:
    """Noise schedule and objective; the sampler is built from the same definition."""

    # "vp_continuous": beta(t) = beta_min + t (beta_max - beta_min), t ~ U(0, 1), net sees 999 t
    # "scaled_linear": discrete Stable-Diffusion betas, step n = k + 1 in {1..1000}
    schedule: str = "vp_continuous"
    beta_min: float = 0.1
    beta_max: float = 20.0
    beta_start: float = 0.00085
    beta_end: float = 0.012
    num_train_timesteps: int = 1000
    p_uncond: float = 0.1  # classifier-free training: caption -> empty context
    # > 0: Min-SNR-gamma loss weighting, each sample's noise MSE times min(SNR, gamma) / SNR
    # (less weight on the low-noise levels); 0: the plain noise MSE of the release.
    min_snr_gamma: float = 0.0
    # "eps": noise prediction on `schedule` (the release's); "velocity": flow matching, the
    # network predicts v = dx_t/dt along `interpolant`, and sees 999 t (uvic.diffusion.flow)
    objective: str = "eps"
    # velocity only: "linear" x_t = (1 - t) x0 + t e; "trigonometric" cos/sin(pi t / 2)
    interpolant: str = "linear"
    # training times: "uniform" t ~ U(0, 1); "logit_normal" t = sigmoid(N(mean, std^2))
    # (continuous time: velocity, or eps on vp_continuous)
    timestep_sampling: str = "uniform"
    logit_normal_mean: float = 0.0
    logit_normal_std: float = 1.0


@dataclass(slots=True)
class OptimConfig:
    """AdamW with linear warm-up, then a constant (or cosine-decaying) learning rate."""

    lr: float = 2e-4
    betas: tuple[float, float] = (0.99, 0.999)
    weight_decay: float = 0.03
    warmup_steps: int = 2500
    grad_clip: float = 0.0  # 0: off (the release does not clip)
    # "constant" after warm-up (the release), or "cosine": decay to 0 at train.max_steps,
    # which gives short runs (the quickstart) a settled final model.
    lr_schedule: str = "constant"


@dataclass(slots=True)
class TrainConfig:
    """Loop length, precision, checkpointing and logging."""

    output_dir: str = "runs/default"
    batch_size: int = 128  # global batch (all processes, after accumulation)
    max_steps: int = 500_000
    grad_accum: int = 1
    # no | fp16 | bf16; "" (unset): the launcher's (`accelerate launch --mixed_precision`,
    # `accelerate config`)
    mixed_precision: str = ""
    ema_decay: float = 0.9999
    seed: int = 1234
    # CPU threads per process (torch's intra-op threads), set by uvic-train, uvic-sample
    # and uvic-fid (`--threads` overrides it): a whole number, or "auto": OMP_NUM_THREADS
    # when set, else the cores this process may use that were free at start, shared by
    # the command's processes on this machine (uvic.cli.threads.auto_threads).
    threads: int | str = "auto"
    # torch.compile of the model through Accelerate (uvic.training.compile): off | default |
    # reduce-overhead (CUDA graphs) | max-autotune | max-autotune-no-cudagraphs. A bool
    # (configs and runs from before the modes) still reads: true = default, false = off.
    compile: bool | str = "off"
    log_every: int = 100
    sample_every: int = 10_000
    ckpt_every: int = 25_000
    keep_last: int = 3
    # Steps whose checkpoints are also written and never pruned, e.g. the early EMA
    # weights that `sample.autoguidance_ckpt` guides with: --set train.keep_steps=[1000]
    keep_steps: tuple[int, ...] = ()
    n_grid: int = 64  # images in the periodic sample grid
    log_with: str = "tensorboard"  # Accelerate tracker(s), comma-separated: wandb, all, ...
    # Post-hoc EMA (EDM2; uvic.training.posthoc_ema): the sigma_rel of each power-function
    # EMA profile kept in training, e.g. (0.05, 0.10); () = off. Every profile is saved to
    # posthoc_ema/ every `posthoc_ema_every` steps (and at train.max_steps); with
    # `posthoc_ema_keep` > 0 at most that many snapshots per profile are kept, the older
    # ones thinned to every 2nd, 4th, ... interval; 0 keeps them all.
    posthoc_ema_stds: tuple[float, ...] = ()
    posthoc_ema_every: int = 5000
    posthoc_ema_keep: int = 0
    # REPA (uvic.training.repa, docs/training.md): an MLP projector maps the patch tokens of
    # block `repa_block` (0-based over in_blocks, mid_block, out_blocks) to a frozen encoder's
    # patch features; loss repa_weight x mean negative cosine. repa_encoder: "" = off; a timm
    # name (vit_base_patch14_dinov2.lvd142m: hub or HF cache), "hf-hub:<repo>" or a local
    # folder in timm's hub layout (config.json + model.safetensors); repa_encoder_weights: a
    # local weights file for a timm name (timm's or DINOv2's own .pth / .safetensors).
    repa_encoder: str = ""
    repa_encoder_weights: str = ""
    repa_block: int = 3
    repa_weight: float = 0.5
    repa_projector_dim: int = 2048  # hidden width of the 3-layer SiLU MLP


@dataclass(slots=True)
class SampleConfig:
    """DPM-Solver (or another diffusers scheduler) sampling."""

    # dpm_solver++ | dpm_solver | dpm_solver++_fast_time_uniform | dpm_solver_fast_logsnr |
    # euler_maruyama | a diffusers class name
    # (see uvic.diffusion.samplers)
    scheduler: str = "dpm_solver++"
    steps: int = 50
    order: int = 2
    # Extra scheduler constructor arguments (a JSON object on the command line), e.g.
    # --set 'sample.scheduler_kwargs={"use_lu_lambdas": false}'
    scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    cfg_scale: float = 1.0  # eps = c + s (c - u); diffusers' guidance_scale = s + 1
    # Autoguidance (Karras et al. 2024, "Guiding a diffusion model with a bad version of
    # itself"): eps = g + s (g - b), g the sampled model, b a weaker one of the same
    # architecture, e.g. an early EMA of the same run (train.keep_steps). 0: off.
    autoguidance_scale: float = 0.0
    # The weaker model's weights; a relative path is taken from the sampled checkpoint's
    # run folder (see uvic.sampling.load.load_guide).
    autoguidance_ckpt: str = ""
    # Guidance interval (Kynkaanniemi et al. 2024): classifier-free and autoguidance only
    # where the noise level sigma = sigma_t / alpha_t (EDM's) lies in (low, high]; elsewhere
    # the conditional model alone, one network call. () = guided at every step; else two
    # numbers, high may be inf: --set sample.guidance_interval=0.3,2.33 (uvic.diffusion.
    # guidance_interval, docs/sampling.md: from a time interval to sigma).
    guidance_interval: tuple[float, ...] = ()
    batch_size: int = 500
    decode_batch_size: int = 50
    # The noise of sample i is seeded by (seed, i): the same seed gives the same images on
    # any device, batch size or process count (and FID's class labels, prompts, KID subsets)
    seed: int = 0
    precision: str = "fp32"  # autocast dtype on CUDA for sampling: fp32 (none) | fp16 | bf16
    # torch.compile of the network call (static shapes: every call of a run sees one batch
    # size, the last batch padded): off | default | reduce-overhead (CUDA graphs on a GPU)
    # | max-autotune (see uvic.sampling.compiled)
    compile: str = "off"


@dataclass(slots=True)
class EvalConfig:
    """FID protocol."""

    n_samples: int = 50_000
    mode: str = "clean"  # clean | legacy_pytorch
    # clean-fid named statistics (dataset, resolution, split) or a local .npz path
    ref_stats: str = "cifar10"
    ref_split: str = "train"
    ref_res: int = 32
    ref_images: str = ""  # folder/source to build custom statistics from if needed
    inception_path: str = ""  # local Inception weights (clean-fid's inception-2015-12-05.pt)
    # inception: FID proper. projection: download-free stand-in features (fixed random
    # projection) to check the pipeline; its numbers are NOT comparable with Inception FID.
    features: str = "inception"
    captions: str = ""  # mscoco: val captions features used to draw prompts
    # beside FID: fd_dinov2 (Frechet distance of DINOv2 ViT-L/14 CLS features) and
    # precision_recall (Kynkaanniemi et al. 2019); see uvic.evaluation.metrics
    metrics: tuple[str, ...] = ("fid",)
    # DINOv2 weights: a local file (timm's or the original torch.hub checkpoint) or a
    # Hugging Face hub name in the local cache; "": torch.hub's dinov2_vitl14_pretrain.pth
    dinov2_path: str = ""
    pr_k: int = 3  # k of the k-NN radii (precision/recall)
    pr_features: str = "inception"  # inception (eval.features' extractor) | dinov2
    pr_n_ref: int = 0  # reference images for precision/recall; 0: as many as samples


@dataclass(slots=True)
class Config:
    """Everything about a run. Saved as `config.json` next to its outputs."""

    name: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
