"""One entry point that checks every value of a config before any work starts.

`validate(cfg)` runs the rules of each section, which live with the code that uses the
values (each domain's `checks` module: `uvic.config.data`, `uvic.config.diffusion`,
`uvic.config.training`, `uvic.config.evaluation`, `uvic.config.sampling`,
`uvic.config.models`). The trainer, the FID evaluator and the sampling CLI call it on
their config; `Diffusion`, `build_dataset` and `UViT` apply the rules of their own
section. `start_config` is a training run's start check (the rules, and the autoguidance
guide its samples will need), run by the trainer and, before torch loads, by the commands
that train. Loading this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from uvic.config import Config, apply_overrides, load_config
from uvic.config.data import check_data
from uvic.config.diffusion import check_diffusion, check_sampler_objective
from uvic.config.evaluation import check_eval
from uvic.config.models import check_model
from uvic.config.sampling import (
    check_guidance_interval,
    check_guide,
    check_sample,
    short_run_guide,
)
from uvic.config.training import check_optim, check_train


def validate(cfg: Config) -> Config:
    """Check every value of `cfg`; returns `cfg` or raises a ConfigError naming the key and
    the value (the first rule broken, sections in the order below)."""
    check_data(cfg.data)
    check_diffusion(cfg.diffusion)
    check_train(cfg.train)
    check_optim(cfg.optim)
    check_eval(cfg.eval)
    check_sample(cfg.sample)
    check_sampler_objective(cfg.diffusion, cfg.sample.scheduler)
    check_guidance_interval(cfg)  # needs the model's conditioning
    check_model(cfg.model)
    return cfg


def start_config(cfg: Config) -> tuple[Config, str | None]:
    """The config a training run starts with, checked, and the note of what it changed: a
    run that ends at or before its own autoguidance guide samples unguided
    (`short_run_guide`), and the guide its samples will need is one the run keeps
    (`check_guide`). The trainer runs it; so do the commands, before torch loads."""
    cfg, note = short_run_guide(cfg)
    validate(cfg)
    check_guide(cfg)
    return cfg, note


def startup_config(path: str | None, overrides: Sequence[str], *,
                   rules: bool = True) -> Config:
    """The config a command will run with, checked before the command imports torch: the
    file loads (`uvic.config.load_config`), every `--set` names a field and parses as its
    type, and with `rules` every section's rules hold (`uvic.config.validation.validate`, which
    the library runs again). `path` None (a config the command finds later, e.g. in a run
    folder): the overrides are checked against the defaults. Raises the ConfigError that
    names the file, key or value; the command prints it and exits, with nothing heavy
    loaded."""
    if path is None:
        return apply_overrides(Config(), list(overrides))
    cfg = load_config(path, list(overrides))
    return validate(cfg) if rules else cfg
