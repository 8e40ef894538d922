"""Samples of one or more checkpoints, from the same noise, into a folder: the work of
`uvic-sample` (grids, optional individual PNGs, `sample_config.json`; docs/sampling.md).
Each checkpoint is built as the architecture it was trained with; the checkpoints of a
side-by-side may differ (U-ViT and U-ViC) but must take the same inputs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from accelerate.utils import gather_object

from uvic.config import Config, to_dict
from uvic.config.sampling import check_guidance, effective_cfg_scale
from uvic.config.validation import validate
from uvic.files import write_json
from uvic.run.architecture import ModelChoice, ResolvedModel, check_same_inputs, resolve_model
from uvic.sampling.assets import SamplingAssets, prompt_contexts, read_prompts, text_encoder
from uvic.sampling.generate import distributed_state, sample_checkpoint
from uvic.sampling.images import save_comparison_grid, save_grid, save_images, to_uint8
from uvic.sampling.labels import LabelFn, class_caption, class_names, label_fn, shown_labels


def checkpoint_labels(
    ckpts: Sequence[str | Path], labels: Sequence[str] | None = None
) -> list[str]:
    """Display labels of checkpoints: the given ones, or each checkpoint's run folder name."""
    if labels:
        if len(labels) != len(ckpts):
            raise ValueError(f"got {len(labels)} --label for {len(ckpts)} --ckpt; give one each")
        return list(labels)
    if len(ckpts) == 1:
        return ["samples"]
    names = [Path(c).parent.name or Path(c).stem for c in ckpts]
    if len(set(names)) < len(names):
        names = [f"{name}_{i}" for i, name in enumerate(names)]
    return names


def _check_labels(labels: Sequence[str]) -> None:
    """Labels name files (`grid_<label>.png`, `<label>/`): distinct after `_slug`."""
    seen: dict[str, str] = {}
    for label in labels:
        if _slug(label) in seen:
            raise ValueError(f"--label {seen[_slug(label)]!r} and {label!r} would write the "
                             f"same files (grid_{_slug(label)}.png); give distinct labels")
        seen[_slug(label)] = label


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "samples"


@dataclasses.dataclass
class _Prompts:
    """What a text-to-image or class-conditional sampling shows: the prompts, each
    sample's context, or each image's class, the grid's captions and row length, and the
    number of images (n rounded to whole prompts or class labels)."""

    total: int
    nrow: int | None
    prompts: list[str] | None = None
    captions: list[str] | None = None
    context_fn: Callable[[list[int]], torch.Tensor] | None = None
    labels: list[int] | None = None  # the class of each image
    label_fn: LabelFn | None = None

    def inputs(self) -> dict[str, Callable | None]:
        """`sample_checkpoint`'s per-sample inputs: each sample's context or class."""
        return {"context_fn": self.context_fn, "label_fn": self.label_fn}

    def record(self) -> dict[str, object]:
        """For sample_config.json: the images, prompts and classes shown."""
        return {"n": self.total, "prompts": self.prompts, "class_labels": self.labels}


def _classes(cfg: Config, n: int, nrow: int | None,
             class_labels: Sequence[int | str] | None) -> _Prompts:
    """The class of each image (`shown_labels`: each of `class_labels` gets max(1, n //
    #labels) images, one grid row each; without them image i shows class i mod K), with
    the classes as grid captions."""
    labels, per_label = shown_labels(cfg, n, class_labels)
    nrow = nrow or (per_label if per_label > 1 else math.ceil(math.sqrt(len(labels))))
    names = class_names(cfg)
    captions = [class_caption(y, names) for y in labels[::per_label]]
    return _Prompts(len(labels), nrow, captions=captions, labels=labels,
                    label_fn=label_fn(labels))


def _assets(cfg: Config, n: int, nrow: int | None, prompts_file: str | Path | None,
            device: torch.device, class_labels: Sequence[int] | None = None,
            say: Callable[[str], None] | None = None) -> tuple[SamplingAssets, _Prompts]:
    """The VAE and empty context, and the prompts: each gets max(1, n // #prompts) images,
    one grid row per prompt. A prompts file is read before CLIP loads (a bad one fails
    first); without one, the feature folder's sample prompts. Class-conditional models
    show `_classes` (bad class labels fail before anything loads; `say` gets the line)."""
    classes = (_classes(cfg, n, nrow, class_labels)
               if class_labels is not None or cfg.model.num_classes > 0 else None)
    if classes is not None and say is not None:
        say(_classes_line(classes))
    if prompts_file is not None and cfg.model.clip_dim <= 0:
        raise ValueError(f"--prompts given but {cfg.name} is not text-conditional "
                         "(model.clip_dim=0)")
    encoder = None
    if prompts_file is not None:
        read_prompts(prompts_file)  # a bad file fails before CLIP loads
        encoder = text_encoder(cfg.data, device)
    assets = SamplingAssets.from_config(cfg, device, encoder)
    if cfg.model.clip_dim <= 0:
        return assets, classes or _Prompts(n, nrow)
    prompts, contexts = prompt_contexts(cfg.data, prompts_file, encoder)
    per_prompt = max(1, n // len(prompts))
    total = per_prompt * len(prompts)
    prompt_of = torch.arange(total) // per_prompt  # image i shows prompt i // per_prompt

    def context_fn(indices: list[int]) -> torch.Tensor:
        return contexts[prompt_of[indices]]

    nrow = nrow or (per_prompt if per_prompt > 1 else math.ceil(math.sqrt(total)))
    return assets, _Prompts(total, nrow, prompts, list(prompts), context_fn)


def sample_to_folder(
    cfg: Config,
    ckpts: Sequence[str | Path],
    out: str | Path,
    *,
    labels: Sequence[str] | None = None,
    n: int = 64,
    prompts_file: str | Path | None = None,
    save_individual: bool = False,
    nrow: int | None = None,
    record: dict | None = None,
    progress: bool = True,
    choice: ModelChoice | None = None,
    upscale: int | None = None,
    say: Callable[[str], None] | None = None,
    class_labels: Sequence[int] | None = None, guidance_option: str | None = None,
) -> dict[str, Path]:
    """Sample `n` images from each checkpoint with the same noise (cfg.sample's seed and
    precision) and write them to `out` (the files of the module docstring; label "samples"
    for one checkpoint).

    `sample_config.json` records the given config, the model built for each checkpoint
    and its source, the prompts and `record`. Grids are enlarged `upscale` times (nearest
    neighbour; None: each grid at least 512 px wide, `uvic.sampling.images.grid_upscale`).
    Each checkpoint is built as `resolve_model(cfg, ckpt, choice)` says (its own stored
    model config); `say` gets one note per checkpoint.
    Text-to-image: prompts from `prompts_file` (else the feature folder's sample prompts);
    class-conditional: `class_labels` (else image i shows class i mod K: `shown_labels`);
    each prompt or label gets max(1, n // #given) images, one grid row each (captioned).
    `guidance_option` (a command line's guidance scale) is refused if unguided.
    Under `accelerate launch` each process samples every num_processes-th image; the main
    process gathers and writes. Returns the written grid paths: "grid" and, with several
    checkpoints, "grid_<label>" each.
    """
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    validate(cfg)
    state = distributed_state()
    device = state.device
    out = Path(out)
    labels, resolved = _resolved(cfg, ckpts, labels, choice)
    given = cfg
    cfg = next(iter(resolved.values())).applied(cfg)  # the inputs
    check_guidance(cfg, guidance_option)
    seed, precision = given.sample.seed, given.sample.precision
    say = say if state.is_main_process else None
    assets, shown = _assets(cfg, n, nrow, prompts_file, device, class_labels, say)

    mine = list(range(shown.total))[state.process_index :: state.num_processes]
    grids: dict[str, torch.Tensor] = {}
    for label, ckpt in zip(labels, ckpts):
        if say is not None:
            say(f"{label}: {resolved[label].note}")
        samples = sample_checkpoint(
            resolved[label].applied(cfg), ckpt, mine, seed=seed,
            device=device, precision=precision, assets=assets, **shown.inputs(),
            progress=progress and state.is_main_process, choice=choice, say=say)
        images = _gathered(samples, state.is_main_process)
        if images is not None:
            grids[label] = images
            if save_individual:
                save_images(images, out / _slug(label), range(shown.total))

    written: dict[str, Path] = {}
    if state.is_main_process:
        written = _write_grids(grids, out, shown, upscale)
        write_json(out / "sample_config.json", {
            "config": to_dict(given),
            "checkpoints": {label: str(c) for label, c in zip(labels, ckpts)},
            "models": {label: {"source": r.source, "model": dataclasses.asdict(r.model),
                               "diffusion": dataclasses.asdict(r.applied(given).diffusion)}
                       for label, r in resolved.items()},
            **shown.record(), "seed": seed, "precision": precision,
            "guidance": effective_cfg_scale(cfg),
            "num_processes": state.num_processes, "device": str(device),
            **(record or {}),
        }, default=str)
    state.wait_for_everyone()
    return written


def _resolved(cfg: Config, ckpts: Sequence[str | Path], labels: Sequence[str] | None,
              choice: ModelChoice | None) -> tuple[list[str], dict[str, ResolvedModel]]:
    """Each checkpoint's label and architecture, all first: a refused one (or checkpoints
    taking different inputs) stops before any work."""
    labels = checkpoint_labels(ckpts, labels)
    _check_labels(labels)
    resolved = {label: resolve_model(cfg, ckpt, choice) for label, ckpt in zip(labels, ckpts)}
    check_same_inputs({f"--ckpt {ckpt}": r.model for ckpt, r in zip(ckpts, resolved.values())})
    return labels, resolved


def _classes_line(shown: _Prompts) -> str:
    """One line naming the classes shown (the first 16 rows or images)."""
    rows = len(shown.captions)
    listed = ", ".join(c.removeprefix("class ") for c in shown.captions[:16])
    more = f", ... ({rows} in all)" if rows > 16 else ""
    each = len(shown.labels) // rows
    layout = f"{each} images each, one grid row per class" if each > 1 else "one image each"
    return f"classes shown: {listed}{more} ({layout})"


def _gathered(samples: Iterator[tuple[list[int], torch.Tensor]],
              is_main: bool) -> torch.Tensor | None:
    """Every process's samples, in index order, as images (N, 3, H, W) in [0, 1] on the main
    process (None on the others); gathered as uint8, the precision of the files."""
    local = []
    for indices, images in samples:
        local += list(zip(indices, to_uint8(images)))
    gathered = sorted(gather_object(local), key=lambda item: item[0])
    if not is_main:
        return None
    return torch.stack([img for _, img in gathered]).permute(0, 3, 1, 2).float() / 255


def _write_grids(grids: dict[str, torch.Tensor], out: Path, shown: _Prompts,
                 upscale: int | None) -> dict[str, Path]:
    """grid.png (side by side with several checkpoints) and grid_<label>.png each."""
    nrow, captions = shown.nrow, shown.captions
    if len(grids) == 1:
        return {"grid": save_grid(next(iter(grids.values())), out / "grid.png", nrow=nrow,
                                  captions=captions, upscale=upscale)}
    written = {"grid": save_comparison_grid(grids, out / "grid.png", nrow=nrow,
                                            captions=captions, upscale=upscale)}
    for label, images in grids.items():
        name = f"grid_{_slug(label)}"
        written[name] = save_grid(images, out / f"{name}.png", nrow=nrow, captions=captions,
                                  upscale=upscale)
    return written
