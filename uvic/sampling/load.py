"""The one way a network is loaded from a checkpoint for inference (sampling, FID,
autoguidance, the attention analysis, the quickstart): built as the architecture the
checkpoint was trained with (`uvic.run.architecture.resolve_model`), weights loaded
strictly, eval mode, no gradients; and the weaker model of autoguidance.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from uvic.config import Config, ConfigError, ModelConfig
from uvic.config.models import MODE_LETTERS, resolve_attention
from uvic.models.uvit import build_model
from uvic.run.architecture import (
    ModelChoice,
    check_same_inputs,
    model_differences,
    resolve_model,
    stored_model_config,
)
from uvic.run.folder import RunFolder, same_file_content
from uvic.run.weights import CheckpointError, load_weights, mismatch_report


def load_model(cfg: Config | ModelConfig, ckpt: str | Path, device: torch.device | str = "cpu",
               choice: ModelChoice | None = None) -> nn.Module:
    """The network of the checkpoint `ckpt` (our EMA .safetensors or a released U-ViT
    `nnet_ema.pth`) with its weights (strict), eval mode, without gradients.

    Given a Config, the architecture is `resolve_model(cfg, ckpt, choice).model`: the
    model config stored with the weights, cfg.model for a file that records none (or with
    `choice.from_config`); a conflicting explicit `model.*` value is a ConfigError. Given
    a ModelConfig (one `resolve_model` chose), exactly that architecture.
    """
    ckpt = Path(ckpt)
    if not ckpt.is_file():
        raise FileNotFoundError(f"checkpoint not found: {ckpt}")
    model = resolve_model(cfg, ckpt, choice).model if isinstance(cfg, Config) else cfg
    net = build_model(model)
    try:
        load_weights(net, ckpt, strict=True)
    except CheckpointError as err:
        raise _another_model(model, ckpt, err) from err
    return net.to(device).eval().requires_grad_(False)


SHOWN_FIELDS = 3  # differing model.* fields a mismatch names in its line; all in its report


def _another_model(model: ModelConfig, ckpt: Path, err: CheckpointError) -> CheckpointError:
    """`err` (weights that do not load into `model`) led by what explains it where the
    checkpoint records its own model config (e.g. under --model-from-config): the first
    few differing fields in the line, all of them and every tensor in a report file."""
    try:
        stored = stored_model_config(ckpt)
    except (ConfigError, CheckpointError):
        stored = None
    diffs = model_differences(model, stored[0]) if stored else []
    if not diffs:
        return err
    saved, source = stored

    def value(config: ModelConfig, key: str) -> str:
        text = repr(getattr(config, key))
        text = text if len(text) <= 40 else text[:37] + "..."
        if key == "attention":  # its blocks: "uvic" is SCS at depth 2, SCCCS at depth 4
            with contextlib.suppress(ConfigError):
                modes = resolve_attention(config.attention, config.depth)
                text += f" ({''.join(MODE_LETTERS[m] for m in modes)})"
        return text

    fields = [f"model.{k}={value(model, k)} (the checkpoint's: {value(saved, k)})"
              for k in diffs]
    more = f" and {len(diffs) - SHOWN_FIELDS} more" if len(diffs) > SHOWN_FIELDS else ""
    report = mismatch_report([f"{ckpt}: the model built differs from the one it was trained "
                              f"as ({source}) in", *fields, "", *err.details], err.report)
    return CheckpointError(
        f"{ckpt} does not fit the model built for it: {', '.join(fields[:SHOWN_FIELDS])}"
        f"{more}, as recorded in {source}; {len(err.details)} tensors differ "
        f"(every difference: {report})", err.details, report)


def load_guide(cfg: Config, ckpt: str | Path, device: torch.device | str = "cpu",
               choice: ModelChoice | None = None,
               say: Callable[[str], None] | None = None,
               fields: Mapping[str, Any] | None = None) -> nn.Module | None:
    """The weaker model of autoguidance for sampling checkpoint `ckpt`, or None when
    `sample.autoguidance_scale` is 0.

    A relative `sample.autoguidance_ckpt` is taken from the run folder of `ckpt`: the
    folder of a run's `ema.safetensors`, the run above `checkpoints/step_N/`. `cfg.model`
    is the sampled model's (`resolve_model(cfg, ckpt).model`); the guide is built as its
    own checkpoint records (`resolve_model`, compared with the sampled model's), and must
    take the same inputs. `say` gets the guide's one-line note; `fields` (model config
    fields, e.g. an export's attention_backend) are set on the guide as built.
    """
    s = cfg.sample
    if s.autoguidance_scale == 0.0:
        return None
    path = Path(s.autoguidance_ckpt)
    if not path.is_absolute():
        path = RunFolder.of_weights(ckpt).root / path
    if not path.is_file():
        raise FileNotFoundError(
            f"sample.autoguidance_ckpt={s.autoguidance_ckpt!r}: weights not found at {path} "
            "(keep an early checkpoint with train.keep_steps, or set "
            "sample.autoguidance_scale=0)")
    if Path(ckpt).is_file() and same_file_content(path, Path(ckpt)):  # e.g. the last step's
        raise ConfigError(
            f"sample.autoguidance_ckpt={s.autoguidance_ckpt!r}: {path} holds the same weights "
            f"as the sampled {ckpt}, and a model guided by itself samples as unguided, at "
            "twice the cost (guide with an earlier checkpoint, or set "
            "sample.autoguidance_scale=0)")
    choice = dataclasses.replace(choice or ModelChoice(), config_name="the sampled model")
    resolved = resolve_model(cfg, path, choice)
    check_same_inputs({f"the model of {ckpt}": cfg.model,
                       f"its guide {path}": resolved.model})
    if say is not None:
        say(f"guide {resolved.note}")
    return load_model(dataclasses.replace(resolved.model, **(fields or {})), path, device)
