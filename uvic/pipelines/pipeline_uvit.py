"""`UViTPipeline`: a diffusers pipeline for uvic's U-ViT / U-ViC, unconditional,
class-conditional or text-to-image (docs/diffusers.md).

    pipe = UViTPipeline.from_pretrained("exported/mscoco_uvic")   # written by uvic-export
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    images = pipe(["a red bus"], num_inference_steps=25, guidance_scale=2.0).images

Sampling runs uvic's own code (`uvic.sampling.generate.sample_images`), so with the same
model, scheduler, steps, guidance and noise the images are `uvic-sample`'s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import PIL.Image
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, ImagePipelineOutput
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils.torch_utils import randn_tensor

from uvic.config import ConfigError, from_dict, inf_to_null
from uvic.config.diffusion import NAMED, diffusers_class
from uvic.diffusion.samplers import model_calls
from uvic.diffusion.schedule import Diffusion
from uvic.models.autoencoder import SCALE_FACTOR
from uvic.models.uvit import UViT
from uvic.pipelines import conventions, guidance
from uvic.sampling.assets import model_to_pixels
from uvic.sampling.generate import sample_images
from uvic.sampling.images import to_uint8
from uvic.sampling.noise import SampleGenerator, make_noise

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


class UViTPipeline(DiffusionPipeline):
    """Generate images with a U-ViT / U-ViC. What is not a component (the schedule, latent
    scale, text encoder name, guidance defaults) is in the pipeline's config, model_index.json.

    Args:
        transformer: the noise-prediction network.
        scheduler: a diffusers scheduler built with the model's noise schedule.
        vae: the autoencoder that decodes latents (latent models only).
        diffusion: uvic's DiffusionConfig as a dict (the schedule and its time input).
        scale_factor: latents are `scale_factor` times the VAE's (the release's 0.23010);
            None for pixel models.
        clip_model, clip_pretrained: the open_clip text encoder of text-to-image models
            (`uvic.models.text_encoder.load_open_clip`'s arguments).
        cfg_scale: default guidance s of `eps = c + s (c - u)`; None: the release's, 1.0
            for text-to-image (its MS-COCO protocol), none (0) for class labels.
        null_class: the class id of "no class" for class-conditional guidance (the
            release's ImageNet models: num_classes - 1); None: no guidance.
        text_encoder: a `ClipTextEncoder` to use instead of loading `clip_model`.
        guidance_interval: the default noise levels (low, high] guided by `__call__`
            (`uvic.diffusion.guidance_interval`, the exported run's sample.guidance_interval);
            None: every step. The config holds an upper bound inf as None (JSON's null).
        guide: the weaker model b of autoguidance, `eps = g + s (g - b)` (a U-ViT taking
            the same inputs: the exported run's `sample.autoguidance_ckpt`); None: none.
        autoguidance_scale: the default s of autoguidance (the run's
            sample.autoguidance_scale); None or 0: off. A nonzero s needs `guide`.
    """

    model_cpu_offload_seq = "transformer->guide->vae"
    _optional_components: ClassVar[list[str]] = ["vae", "guide"]
    _callback_tensor_inputs: ClassVar[list[str]] = conventions.CALLBACK_TENSOR_INPUTS

    def __init__(
        self,
        transformer: UViT,
        scheduler: SchedulerMixin,
        vae: AutoencoderKL | None = None,
        diffusion: dict[str, Any] | None = None,
        scale_factor: float | None = SCALE_FACTOR,
        clip_model: str | None = None,
        clip_pretrained: str | None = None,
        cfg_scale: float | None = None,
        null_class: int | None = None,
        text_encoder: torch.nn.Module | None = None,
        guidance_interval: Sequence[float] | None = None,
        guide: UViT | None = None,
        autoguidance_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae,
                              guide=guide)
        guidance.check_guide(transformer, guide, autoguidance_scale)
        diffusion = dict(diffusion or {})
        try:
            self.diffusion = Diffusion(from_dict({"diffusion": diffusion},
                                                 source="the pipeline's diffusion").diffusion)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        m = transformer.config
        if m.clip_dim > 0 and not clip_model and text_encoder is None:
            raise ValueError("a text-conditional U-ViT needs clip_model (the open_clip text "
                             "encoder to load) or a text_encoder")
        if null_class is not None and not 0 <= null_class < max(m.num_classes, 0):
            raise ValueError(f"null_class={null_class} is not a class id of this model "
                             f"(num_classes={m.num_classes})")
        self.register_to_config(diffusion=diffusion, scale_factor=scale_factor,
                                clip_model=clip_model, clip_pretrained=clip_pretrained,
                                cfg_scale=cfg_scale, null_class=null_class,
                                guidance_interval=inf_to_null(guidance.guidance_interval(
                                    guidance_interval)) or None,  # strict JSON: inf as null
                                autoguidance_scale=autoguidance_scale)
        self._text_encoder = text_encoder

    def save_pretrained(self, save_directory: str, *args: Any, push_to_hub: bool = False,
                        **kwargs: Any) -> None:
        """diffusers' `save_pretrained`, plus the entry module that lets
        `DiffusionPipeline.from_pretrained` load the folder (`conventions.write_entry`)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        conventions.write_entry(save_directory, type(self).__name__)
        if push_to_hub:  # after the entry is written: the Hub gets it too
            conventions.push_folder(self, save_directory, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike,
                        **kwargs: Any) -> Any:
        """diffusers' `from_pretrained` of a saved folder or a Hub repository (fetched
        first as a folder: `conventions.hub_folder`), loaded as this class: the folder's
        entry module is never run, so no `trust_remote_code` is needed."""
        folder = pretrained_model_name_or_path
        if not os.path.isdir(folder):
            folder = conventions.hub_folder(str(folder), kwargs)
        return super().from_pretrained(folder, **kwargs)

    @classmethod
    def load_config(cls, *args: Any, **kwargs: Any) -> Any:
        """diffusers' `ConfigMixin.load_config` (what `from_pretrained` reads a folder's
        model_index.json with); loaded by this class itself, a saved folder's [module,
        class] `_class_name` is this class (`conventions.class_named`)."""
        out = super().load_config(*args, **kwargs)
        conventions.class_named(out[0] if isinstance(out, tuple) else out, cls.__name__)
        return out

    # ------------------------------------------------------------------ text

    @property
    def text_encoder(self) -> torch.nn.Module:
        """The CLIP text encoder (`uvic.models.text_encoder.ClipTextEncoder`: the release's
        tokenization and token states), loaded from `clip_model` on first use."""
        if self._text_encoder is None:
            if not self.config.clip_model:
                raise ValueError("this U-ViT is not text-conditional: it has no text encoder")
            from uvic.models.text_encoder import ClipTextEncoder  # open_clip: only when needed

            self._text_encoder = ClipTextEncoder(self.config.clip_model,
                                                 self.config.clip_pretrained or None,
                                                 self._execution_device)
        return self._text_encoder

    def encode_prompt(
        self, prompt: str | Sequence[str], num_images_per_prompt: int = 1,
        negative_prompt: str | Sequence[str] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds (n, 77, D), negative_prompt_embeds (n, 77, D)), each prompt
        repeated `num_images_per_prompt` times; the negative is the empty caption "" (what
        the release's models were trained to drop captions to) unless given."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if negative_prompt is None:
            negatives = [""] * len(prompts)
        else:
            negatives = ([negative_prompt] * len(prompts) if isinstance(negative_prompt, str)
                         else list(negative_prompt))
            if len(negatives) != len(prompts):
                raise ValueError(f"negative_prompt has {len(negatives)} entries for "
                                 f"{len(prompts)} prompts")
        encoder = self.text_encoder.to(self._execution_device)
        embeds = encoder.encode(prompts)
        # "" once, as uvic-sample encodes the empty prompt
        uncond = (encoder.encode([""]).expand(len(prompts), -1, -1) if negative_prompt is None
                  else encoder.encode(negatives))
        return (embeds.repeat_interleave(num_images_per_prompt, dim=0),
                uncond.repeat_interleave(num_images_per_prompt, dim=0))

    # ------------------------------------------------------------------ sampling

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        class_labels: int | list[int] | torch.Tensor | None = None,
        num_images_per_prompt: int = 1,
        batch_size: int | None = None,
        num_inference_steps: int = 50,
        guidance_scale: float | None = None,
        cfg_scale: float | None = None,
        guidance_interval: Sequence[float] | None = None,
        autoguidance_scale: float | None = None,
        sampler: str | None = None,
        order: int = 2,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: Any = None,
        callback_on_step_end_tensor_inputs: list[str] | None = None,
    ) -> ImagePipelineOutput | tuple:
        """Generate images.

        Args:
            prompt: text-to-image: a caption or a list of them (or `prompt_embeds`).
            negative_prompt: the captions guided away from (default: the empty caption).
            class_labels: class-conditional: class ids in [0, num_classes).
            num_images_per_prompt: images per caption or class label.
            batch_size: unconditional models: how many images (default 1).
            num_inference_steps: the scheduler's steps.
            guidance_scale: diffusers' g of `eps = u + g (c - u)`; or give `cfg_scale`, the
                release's s of `eps = c + s (c - u)` (g = s + 1). Default: the pipeline's
                `cfg_scale` (the exported run's sample.cfg_scale); 1 / 0 = no guidance.
            guidance_interval: guide only where sigma is in (low, high]; () everywhere.
            autoguidance_scale: s of autoguidance `eps = g + s (g - b)` by the pipeline's
                `guide` b; default: the pipeline's (the exported run's
                sample.autoguidance_scale); 0: off.
            sampler: one of uvic's protocols (`dpm_solver++`, `euler_maruyama`, ...; for
                velocity models `flow_euler`, `flow_heun`, `flow_euler_maruyama`) or a
                diffusers scheduler class name, built for this schedule as `uvic-sample
                --scheduler` builds it (with `order`); default: `self.scheduler` (a
                velocity model's: diffusers' FlowMatchEulerDiscreteScheduler).
            generator: one torch generator, or one per image; uvic's per-sample
                `SampleGenerator`s (`sample_generators(seed, range(n))`) draw the noise of
                `uvic-sample --seed seed`.
            latents: the initial noise x_T (n, C, H, W) instead of drawing it.
            prompt_embeds, negative_prompt_embeds: CLIP token states (n, 77, D) instead of
                prompts (e.g. a uvic feature folder's contexts).
            output_type: "pil" (PIL images), "np" (float (n, H, W, 3) in [0, 1]), "pt"
                (float (n, 3, H, W) in [0, 1]) or "latent" (model-space samples, undecoded).
            return_dict: an `ImagePipelineOutput`, else a tuple `(images,)`.
            callback_on_step_end, callback_on_step_end_tensor_inputs: diffusers' step
                callback `f(pipe, i, t, {"latents": x})`, whose returned "latents" the
                loop continues from (with a diffusers scheduler; `conventions`).
        """
        device = self._execution_device
        _check_counts(output_type, num_inference_steps, num_images_per_prompt)
        cond = self._conditioning(prompt, negative_prompt, class_labels, num_images_per_prompt,
                                  batch_size, prompt_embeds, negative_prompt_embeds, device)
        n = cond.pop("n")
        m = self.transformer.config
        guided = guidance.resolve(self.config, m.clip_dim, cond, guidance_scale, cfg_scale,
                                  guidance_interval)
        guided.update(guidance.autoguidance(self.config, self.guide, autoguidance_scale))
        noise = self._initial_noise(n, (m.in_chans, m.img_size, m.img_size), generator,
                                    latents, device)

        scheduler = conventions.with_callback(
            self, self.scheduler if sampler is None else self._named(sampler), order,
            num_inference_steps, callback_on_step_end, callback_on_step_end_tensor_inputs)
        calls = model_calls(self.diffusion, scheduler, num_inference_steps, order)
        precision = (torch.autocast(device.type, dtype=self.transformer.dtype)
                     if self.transformer.dtype != torch.float32 else contextlib.nullcontext())
        with self.progress_bar(total=calls) as bar, precision:
            x0 = sample_images(
                self.transformer, self.diffusion, noise, scheduler=scheduler,
                steps=num_inference_steps, order=order, generator=generator,
                on_step=bar.update, **guided, **cond)
        images = self._output(x0, output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return ImagePipelineOutput(images=images)

    def _output(self, x0: torch.Tensor, output_type: str):
        """Model-space samples as `output_type` (see `__call__`)."""
        if output_type == "latent":
            return x0
        images = model_to_pixels(x0, self.vae, self.config.scale_factor)
        if output_type == "np":
            return images.permute(0, 2, 3, 1).cpu().numpy()
        if output_type == "pil":
            return [PIL.Image.fromarray(a) for a in to_uint8(images).numpy()]
        return images

    # ------------------------------------------------------------------ inputs

    def _conditioning(
        self, prompt, negative_prompt, class_labels, per: int, batch_size: int | None,
        prompt_embeds: torch.Tensor | None, negative_prompt_embeds: torch.Tensor | None,
        device: torch.device,
    ) -> dict[str, Any]:
        """{"n": images, plus sample_images' context/uncond_context or y}; refuses
        conditioning the model does not take, or lacks, in one line."""
        m = self.transformer.config
        kind = ("text-conditional" if m.clip_dim > 0 else
                "class-conditional" if m.num_classes > 0 else "unconditional")
        text = prompt is not None or prompt_embeds is not None
        if text and m.clip_dim <= 0:
            raise ValueError(f"prompt given but this U-ViT is {kind} (clip_dim=0): it takes no "
                             "text")
        if class_labels is not None and m.num_classes <= 0:
            raise ValueError(f"class_labels given but this U-ViT is {kind} (num_classes="
                             f"{m.num_classes})")
        if batch_size is not None and kind != "unconditional":
            raise ValueError(f"batch_size is for unconditional models; this {kind} one makes "
                             "num_images_per_prompt images per prompt or class label")
        if kind == "unconditional":
            n = batch_size if batch_size is not None else 1
            if n < 1:
                raise ValueError(f"batch_size={n} must be >= 1")
            return {"n": n * per}
        if kind == "class-conditional":
            if class_labels is None:
                raise ValueError(f"this class-conditional U-ViT needs class_labels, ids in "
                                 f"[0, {m.num_classes})")
            labels = torch.as_tensor(class_labels).reshape(-1)
            if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
                raise ValueError(f"class_labels must be integers, got {labels.dtype}")
            bad = labels[(labels < 0) | (labels >= m.num_classes)]
            if bad.numel():
                raise ValueError(f"class_labels must be in [0, {m.num_classes}): got "
                                 f"{int(bad[0])}")
            y = labels.long().repeat_interleave(per).to(device)
            return {"n": len(y), "y": y}
        if not text:
            raise ValueError("this text-conditional U-ViT needs a prompt (or prompt_embeds)")
        if prompt is not None and prompt_embeds is not None:
            raise ValueError("give prompt or prompt_embeds, not both")
        if prompt is not None:
            if negative_prompt_embeds is not None:
                raise ValueError("negative_prompt_embeds go with prompt_embeds; with a prompt "
                                 "give negative_prompt")
            context, uncond = self.encode_prompt(prompt, per, negative_prompt)
        else:
            if negative_prompt is not None:
                raise ValueError("negative_prompt goes with prompt; with prompt_embeds give "
                                 "negative_prompt_embeds")
            context = prompt_embeds.repeat_interleave(per, dim=0)
            uncond = (negative_prompt_embeds.repeat_interleave(per, dim=0)
                      if negative_prompt_embeds is not None
                      else self.text_encoder.to(device).encode([""])[0])
        shape = (m.num_clip_token, m.clip_dim)
        if context.dim() != 3 or tuple(context.shape[1:]) != shape:
            raise ValueError(f"prompt_embeds must have shape (n, {shape[0]}, {shape[1]}), got "
                             f"{tuple(context.shape)}")
        if tuple(uncond.shape[-2:]) != shape or (uncond.dim() == 3 and len(uncond) != len(context)):
            raise ValueError(f"negative_prompt_embeds must have shape ({len(context)}, "
                             f"{shape[0]}, {shape[1]}), got {tuple(uncond.shape)}")
        return {"n": len(context), "context": context.to(device),
                "uncond_context": uncond.to(device)}

    def _initial_noise(
        self, n: int, shape: tuple[int, ...], generator, latents: torch.Tensor | None,
        device: torch.device,
    ) -> torch.Tensor:
        """x_T: `latents`, uvic's per-sample noise for SampleGenerators, else randn_tensor."""
        if latents is not None:
            if tuple(latents.shape) != (n, *shape):
                raise ValueError(f"latents must have shape ({n}, {', '.join(map(str, shape))}), "
                                 f"got {tuple(latents.shape)}")
            return latents.to(device=device, dtype=torch.float32)
        if isinstance(generator, list):
            if len(generator) != n:
                raise ValueError(f"generator: {len(generator)} generators for {n} images; give "
                                 "one, or one per image")
            if all(isinstance(g, SampleGenerator) for g in generator):
                return make_noise(shape, generator, device)
        return randn_tensor((n, *shape), generator=generator, device=device, dtype=torch.float32)

    def _named(self, sampler: str) -> str:
        """A `sampler=` name, checked: uvic's protocols or a diffusers scheduler class."""
        if sampler not in NAMED:
            try:
                diffusers_class(sampler)
            except ValueError:
                raise ValueError(f"sampler={sampler!r} is neither one of uvic's {list(NAMED)} "
                                 "nor a diffusers scheduler class name") from None
        return sampler


def _check_counts(output_type: str, steps: int, per: int) -> None:
    """`__call__`'s output type, steps and images per prompt, before any work."""
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type={output_type!r}: choose one of {OUTPUT_TYPES}")
    if steps < 1:
        raise ValueError(f"num_inference_steps={steps} must be >= 1")
    if per < 1:
        raise ValueError(f"num_images_per_prompt={per} must be >= 1")
