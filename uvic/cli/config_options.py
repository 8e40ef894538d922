"""The config options the uvic commands share, declared once: `--config` (a file or a
preset's name, resolved as it is parsed), `--set KEY=VALUE` and `--model-from-config`;
`uvic.config.validation.startup_config` checks what they give before torch loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from uvic.presets import resolve_config


class ConfigAction(argparse.Action):
    """Store the config file that `--config TEXT` names: TEXT itself when it is a file (or
    no preset either: the config loader then names the missing file), else the preset
    file of that name."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        try:
            path = resolve_config(str(values))
        except FileNotFoundError as err:  # an unknown preset name: the presets are listed
            parser.exit(2, f"error: {err}\n")
        setattr(namespace, self.dest, str(path))


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """`--set KEY=VALUE` (repeatable, into `args.set`): config overrides, applied in order."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set train.batch_size=64 "
                        "(repeatable)")


def add_config_options(parser: argparse.ArgumentParser, *, model_from_config: bool = False,
                       optional_config: str | None = None) -> None:
    """`--config` (required unless `optional_config` says what its absence means), then
    `--set` and, with `model_from_config`, `--model-from-config`: build the model as the
    config says rather than as a checkpoint records it (`uvic.run.architecture`)."""
    absent = "" if optional_config is None else f" (default: {optional_config})"
    parser.add_argument("--config", action=ConfigAction, required=optional_config is None,
                        help=f"configs/*.py, a preset's name (cifar10_uvic) or a run's "
                        f"config.json{absent}")
    add_set_option(parser)
    if model_from_config:
        parser.add_argument("--model-from-config", action="store_true",
                            help="build the model of every checkpoint, and sample it with the "
                            "diffusion settings, as --config and --set say, not as stored "
                            "with it (e.g. to run a checkpoint under another attention "
                            "pattern)")
