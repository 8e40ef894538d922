"""The documentation is tested: the README and every page in docs/ (`readme_commands.PAGES`).
Every command in them runs here at tiny scale or says why it cannot, their numbers (steps,
defaults, sizes, file names) are those of the code, and their links reach their targets.

`COMMANDS` has one entry per documented command, keyed by the command as its page writes it
(`readme_commands.readme_commands`: the ```bash blocks and whole commands in the prose of
every page; "README command" below means any of them):

* `Run`: the command runs here, as a subprocess in a fresh folder, with the README's own
  words (`readme_commands.command_line`) followed by `add`: tiny-scale, CPU and offline
  settings only (a later `--set` or flag overrides the README's). The folder holds the
  entry's `needs`: data in the real on-disk formats (tests/datagen.py) and tiny runs of
  the real training loop, made once per session. The result is then checked: exit 0, the
  files docs/outputs.md's "Where outputs go" names, the README's own `--set` values in the
  saved config, and the entry's `check`.
* `Elsewhere`: a test file runs the command itself, taking it from the README.
* `Same`: the command runs what another README command runs.
* `NotHere`: the command needs what a test cannot have (GPUs, the network, Inception
  weights) or is the test suite itself; `why` says which. Its launcher flags, script
  flags and config (with the entry's `add`) are still checked, as for every command.

A command without an entry, or an entry whose command left every page, fails
`test_every_readme_command_has_an_entry`: add or update the entry. A page's numbers are its
`CLAIMS` (one list per page).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import runpy
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from unittest import mock

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from datagen import (
    fake_cifar10_checksums,
    make_cifar10,
    make_coco,
    make_imagenet,
    make_mscoco_features,
    tiny_clip_folder,
    tiny_vae_folder,
)
from readme_commands import (
    PAGES,
    README,
    ROOT,
    VENV,
    command_line,
    make_recipe,
    page,
    readme_commands,
    section,
    split_env,
)

from uvic.config import Config, apply_overrides, from_dict, load_config
from uvic.config.validation import validate
from uvic.data.datasets import save_shapes_folder
from uvic.models.uvit import build_model
from uvic.run.folder import RunFolder


def flat(name: str) -> str:
    """Page `name` with line breaks as spaces, for its sentences."""
    return " ".join(page(name).split())


SHIMS = Path(__file__).with_name("shims")  # sitecustomize.py: generated CIFAR-10 passes


def sets(*overrides: str) -> tuple[str, ...]:
    return tuple(word for o in overrides for word in ("--set", o))


def set_values(words: list[str] | tuple[str, ...]) -> list[str]:
    """The `--set KEY=VALUE` (or `--set=KEY=VALUE`) values of a command, in order."""
    values = []
    for i, word in enumerate(words):
        if word == "--set" and i + 1 < len(words):
            values.append(words[i + 1])
        elif word.startswith("--set="):
            values.append(word.removeprefix("--set="))
    return values


def short(command: str) -> str:
    """A test id: the command, its middle left out when long."""
    return command if len(command) <= 90 else f"{command[:55]}...{command[-32:]}"


def option(words: list[str] | tuple[str, ...], name: str) -> str | None:
    """The last value of option `name` in a command (argparse: the last one wins)."""
    values = [words[i + 1] for i, w in enumerate(words[:-1]) if w == name]
    return values[-1] if values else None


# --------------------------------------------------------------------------- settings

# The paper configs' 44M-parameter models on a CPU in seconds: 2+1 blocks of width 32.
CIFAR10_MODEL = sets("model.embed_dim=32", "model.depth=2", "model.num_heads=2",
                     "model.patch_size=4", "model.attention_backend=torch")
MSCOCO_MODEL = sets("model.img_size=8", "model.patch_size=2", "model.embed_dim=32",
                    "model.depth=2", "model.num_heads=2", "model.clip_dim=32",
                    "model.attention_backend=torch")
# The VAE and CLIP text encoder, random and tiny, from local folders (no download).
MSCOCO_OFFLINE = sets("data.vae={assets}/vae", "data.clip_model=local-dir:{assets}/clip",
                      "data.clip_pretrained=")
IMAGENET_OFFLINE = ("--device", "cpu", "--vae", "{assets}/vae", "--resolution", "64",
                    "--workers", "0", "--no-progress")
# The ImageNet-256 U-ViT-L/2 made tiny (8x8 latents), decoded by the tiny local VAE.
IMAGENET256_MODEL = sets("model.img_size=8", "model.embed_dim=32", "model.depth=2",
                         "model.num_heads=2", "model.attention_backend=torch")
IMAGENET_VAE = sets("data.vae={assets}/vae")
# Two steps, a checkpoint and a sample grid; fp32 (the paper configs' fp16 needs a GPU).
TRAIN = sets("train.mixed_precision=no", "data.num_workers=0", "train.max_steps=2",
             "train.batch_size=4", "train.log_every=1", "train.ckpt_every=2",
             "train.sample_every=2", "train.n_grid=2", "sample.steps=2", "sample.batch_size=2")
SAMPLE = ("--n", "4", "--steps", "3")
# The runs the commands find (`needs`) keep step 1 as the autoguidance model.
GUIDE_STEP = 1
GUIDE = str(RunFolder("").checkpoint(GUIDE_STEP) / RunFolder.EMA)


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Run:
    """Runs here: the README's words + `add`, in a folder holding `needs` (`Assets`)."""

    add: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    outputs: str | None = None  # the row of "Where outputs go" whose files it writes
    check: Callable[[Path, subprocess.CompletedProcess], None] | None = None


@dataclass(frozen=True)
class Elsewhere:
    """Run by `test_file`, which takes the command from the README."""

    test_file: str


@dataclass(frozen=True)
class Same:
    """Runs exactly what README command `command` runs."""

    command: str


@dataclass(frozen=True)
class NotHere:
    """Cannot run in a test, because `why`; flags and config (with `add`) are checked."""

    why: str
    add: tuple[str, ...] = ()
    check: Callable[[], None] | None = None


def run_folder(ws: Path, run: str = "runs/cifar10_uvic") -> dict:
    return json.loads((ws / run / "summary.json").read_text())


def resumed(ws: Path, proc: subprocess.CompletedProcess) -> None:
    summary = run_folder(ws)
    assert summary["resumed_from"] and summary["steps"] == 4, summary


def started_over(ws: Path, proc: subprocess.CompletedProcess) -> None:
    summary = run_folder(ws)
    assert summary["resumed_from"] is None and summary["steps"] == 2, summary
    first = json.loads((ws / "runs/cifar10_uvic/log.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1


def keeps_step_1(ws: Path, proc: subprocess.CompletedProcess) -> None:
    assert (ws / "runs/cifar10_uvic" / GUIDE).is_file()


def features_complete(ws: Path, proc: subprocess.CompletedProcess) -> None:
    assert "features complete in data/mscoco_features" in proc.stdout
    assert (ws / "data/mscoco_features/val").is_dir()


def imagenet_features_complete(resolution: int) -> Callable[[Path, subprocess.CompletedProcess],
                                                               None]:
    def check(ws: Path, proc: subprocess.CompletedProcess) -> None:
        folder = f"data/imagenet{resolution}_features"
        assert f"features complete in {folder}" in proc.stdout
        assert "train: 9 images in 3 classes" in proc.stdout
        assert json.loads((ws / folder / "train/progress.json").read_text())["complete"]
    return check


def shows_classes(*labels: int) -> Callable[[Path, subprocess.CompletedProcess], None]:
    def check(ws: Path, proc: subprocess.CompletedProcess) -> None:
        record = json.loads((ws / "samples/imagenet256/sample_config.json").read_text())
        assert record["class_labels"] == list(labels), record["class_labels"]
        # each class by number, WordNet id and name: "207 n02099601 golden retriever, ..."
        shown = re.search(r"classes shown: (.*) \((?:one image|\d+ images) each", proc.stdout)
        assert shown, proc.stdout
        items = shown.group(1).split(", ")
        assert [int(item.split()[0]) for item in items] == list(labels), items
        assert all(re.fullmatch(r"\d+ n\d{8} \S.*", item) for item in items), items
    return check


def writes(*paths: str) -> Callable[[Path, subprocess.CompletedProcess], None]:
    def check(ws: Path, proc: subprocess.CompletedProcess) -> None:
        for path in paths:
            assert (ws / path).is_file(), path
    return check


def shows_the_absent_cell(table: str) -> Callable[[Path, subprocess.CompletedProcess], None]:
    """Differential attention pairs heads: its 1-head cell is said to be skipped and shown
    as absent, the others are trained (gated designs included)."""
    def check(ws: Path, proc: subprocess.CompletedProcess) -> None:
        assert "skipped (differential attention pairs heads): differential with 1 head" in (
            proc.stdout)
        text = (ws / table).read_text()
        assert "| differential | — |" in text and "| cog+gate |" in text
    return check


def states_the_gated_compute(ws: Path, proc: subprocess.CompletedProcess) -> None:
    """--dry-run times one model, states the compute and writes nothing."""
    assert proc.stdout.startswith("compute: 9 models; one (softmax, 1 heads, n = 1) took")
    assert not (ws / "runs/gated/capacity").exists()


def exported(folder: str, size: int, **inputs: object
             ) -> Callable[[Path, subprocess.CompletedProcess], None]:
    """The command wrote a pipeline folder that `UViTPipeline.from_pretrained` loads and
    samples from (2 steps)."""
    def check(ws: Path, proc: subprocess.CompletedProcess) -> None:
        from uvic.pipelines import UViTPipeline

        pipe = UViTPipeline.from_pretrained(ws / folder)
        pipe.set_progress_bar_config(disable=True)
        assert pipe(num_inference_steps=2, **inputs).images[0].size == (size, size)
    return check


def plan_states_the_readme_compute(ws: Path, proc: subprocess.CompletedProcess) -> None:
    """docs/evaluation.md's compute figures are the plan's: images x network calls per
    image."""
    claim = re.search(r"CIFAR-10: ([\d,]+) x (\d+) = ([\de.]+) image forwards per model; "
                      r"MS-COCO: ([\d,]+) x (\d+) x (\d+) = ([\de.]+)",
                      flat("docs/evaluation.md"))
    assert claim, "docs/evaluation.md no longer states the FID compute"
    n10, calls10, total10, n_coco, steps, passes, total_coco = claim.groups()
    for n, calls, total in ((n10, int(calls10), total10),
                            (n_coco, int(steps) * int(passes), total_coco)):
        assert float(n.replace(",", "")) * calls == float(total)
        assert f"{n} samples x {calls} network calls = {int(float(total)):,}" in proc.stdout


def plan_states_the_release_compute(ws: Path, proc: subprocess.CompletedProcess) -> None:
    """The release table's plan names every row and model, under the row's protocol."""
    from uvic.evaluation.protocols import RELEASE_ROWS

    for key, row in RELEASE_ROWS.items():
        for model in ("uvit", "uvic"):
            assert f"- {key} / {model}: train " in proc.stdout
        assert f"protocol: {row.protocol.label()}" in proc.stdout


def sampler_figures(output: str) -> dict[tuple, float]:
    """The errors `python tests/test_samplers.py` prints: a grid row as (section, order,
    steps, "time" | "logSNR"), any other line as (its label,), the text before its colon
    or before ": vs the release's formula"."""
    figures: dict[tuple, float] = {}
    section = ""
    for line in output.splitlines():
        grid = re.match(r"\s+order (\d), (\d+) steps: time-uniform (\S+)\s+logSNR-uniform (\S+)",
                        line)
        numbers = re.findall(r"\d\.\d+e[-+]\d+", line)
        if grid:
            order, steps, time_grid, lu_grid = grid.groups()
            figures[(section, int(order), int(steps), "time")] = float(time_grid)
            figures[(section, int(order), int(steps), "logSNR")] = float(lu_grid)
        elif not line.startswith(" "):
            section = line.split(":")[0]
            if numbers:
                figures[(section,)] = float(numbers[-1])
        elif numbers:
            figures[(line.split(": vs the release")[0].strip(),)] = float(numbers[-1])
    return figures


def agrees(readme: str, value: float) -> bool:
    """A figure the README rounds to two digits (e.g. 1.7e-1) is `value`, printed to three."""
    exponent = int(readme.split("e")[1])
    return abs(value - float(readme)) <= 0.055 * 10.0**exponent


def samplers_print_the_readme_figures(ws: Path, proc: subprocess.CompletedProcess) -> None:
    """docs/fidelity.md's sampler figures are those `tests/test_samplers.py` prints."""
    got = sampler_figures(proc.stdout)
    doc, fidelity = page("docs/fidelity.md"), flat("docs/fidelity.md")

    def line(prefix: str) -> float:
        keys = [k for k in got if len(k) == 1 and k[0].startswith(prefix)]
        assert len(keys) == 1, f"{prefix!r}: {keys} in {proc.stdout}"
        return got[keys[0]]

    expected: dict[tuple, str] = {}
    for schedule, part in (("VP (CIFAR-10)", "vp_continuous"),
                           ("scaled-linear (MS-COCO)", "scaled_linear")):
        for order in (2, 3):
            row = re.search(rf"^\| {re.escape(schedule)}, {order} \| (.+) \|$", doc, re.M)
            assert row, f"no Fidelity table row for {schedule}, order {order}"
            for steps, cell in zip((10, 25, 50), row.group(1).split(" | "), strict=True):
                time_grid, lu_grid = cell.split(" / ")
                expected[(part, order, steps, "time")] = time_grid
                expected[(part, order, steps, "logSNR")] = lu_grid
    random = "vp_continuous, Gaussian + 0.1 random U-ViT"
    sentence = re.search(r"order 3 at 50 steps (\S+) \(time\) / (\S+) \(logSNR\), order 2 at "
                         r"50 steps (\S+) / (\S+), 25 steps (\S+) / (\S+)\.", fidelity)
    assert sentence, "docs/fidelity.md no longer gives the random-U-ViT figures"
    for (order, steps, grid), text in zip(
            [(3, 50, "time"), (3, 50, "logSNR"), (2, 50, "time"), (2, 50, "logSNR"),
             (2, 25, "time"), (2, 25, "logSNR")], sentence.groups(), strict=True):
        expected[(random, order, steps, grid)] = text
    for key, text in expected.items():
        assert agrees(text, got[key]), f"docs {text}, printed {got[key]:.2e}: {key}"
    sentences = {
        r"same noise and increments, (\S+) relative L2": "euler_maruyama",
        r"the MS-COCO DPM-Solver\+\+ fast \(`dpm_solver_pp.py`\) (\S+)":
            "dpm_solver++_fast_time_uniform (ours)",
        r"continuous-time DPM-Solver fast \(`dpm_solver_pytorch.py`\) (\S+) \(float32 rounding\)":
            "dpm_solver_fast_logsnr (ours)",
        r"on Gaussian data it lands (\S+) from\s+the release's result":
            "diffusers singlestep order 3",
        r"our multistep DPM-Solver\+\+ (\S+) \(logSNR grid":
            "dpm_solver++ order 2, logSNR-uniform",
        r"on the time-uniform\s+one, (\S+)\)": "dpm_solver++ order 2, time-uniform",
        r"The release's protocol itself ends (\S+) from the exact ODE solution":
            "release DPM-Solver++ fast",
        r"500-step solutions that agree to (\S+) on both grids": random,
    }
    for pattern, prefix in sentences.items():
        found = re.search(pattern, fidelity)
        assert found, f"docs/fidelity.md no longer says: {pattern}"
        assert agrees(found.group(1), line(prefix)), (pattern, line(prefix))


def quickstart_config_is_valid(command: str) -> Callable[[], None]:
    """The quickstart's own checks (the autoguidance model included) pass for `command`."""
    def check() -> None:
        from uvic.cli.quickstart import parse_args
        from uvic.experiments.quickstart_steps import build_config

        words = command_line(command)[1]
        assert runpy.run_path(words[1], run_name="readme_quickstart")["main"] is not None
        build_config(parse_args(words[2:]))
    return check


def make_test_runs_ruff_and_pytest() -> None:
    lines = make_recipe("make test")
    assert lines[0].endswith("ruff check .") and "-m pytest" in lines[1]


def trained_by_flow_matching(ws: Path, proc: subprocess.CompletedProcess) -> None:
    """The run's saved config is the velocity objective's, sampled by a flow sampler."""
    cfg = load_config(ws / "runs/cifar10_uvic_flow/config.json")
    assert (cfg.diffusion.objective, cfg.sample.scheduler) == ("velocity", "flow_heun")


ACCELERATE_GPUS = "several GPUs (Accelerate's --multi_gpu launch of {n} processes)"
INCEPTION = ("Inception weights and reference statistics (a download: `eval.inception_path`, "
             "clean-fid's cache)")

COMMANDS: dict[str, Run | Elsewhere | Same | NotHere] = {
    "make quickstart": Elsewhere("tests/test_quickstart.py"),
    "python scripts/train.py --config configs/quickstart.py --set "
    "train.repa_encoder=models/dinov2_vits14 --set train.repa_block=1 --set "
    "train.output_dir=runs/quickstart_repa": Elsewhere("tests/test_repa.py"),
    "make test": NotHere("the test suite itself (CI runs it from a clean clone)",
                         check=make_test_runs_ruff_and_pytest),
    "make test-fast": NotHere("the suite without its slow tests (the inner loop)"),
    "python scripts/train.py --config configs/cifar10_uvic.py --set train.batch_size=64 "
    "--set optim.lr=1e-4": Run(CIFAR10_MODEL + TRAIN, ("cifar10",), "a training run"),
    # U-ViS (sigmoid attention, a learnable bias per head) on the built-in shapes
    "python scripts/train.py --config configs/quickstart.py --set model.attention=uvis "
    "--set model.sigmoid_bias_learnable=true --set train.max_steps=40 "
    "--set sample.autoguidance_scale=0 --set train.output_dir=runs/quickstart_uvis":
        Run(TRAIN + sets("data.num_images=8"), (), "a training run"),
    # torchvision verifies the files already there instead of downloading them
    "accelerate launch scripts/train.py --config configs/cifar10_uvic.py "
    "--set data.download=true": Run(CIFAR10_MODEL + TRAIN, ("cifar10",), "a training run"),
    # flow matching (README, docs/recipes.md): the grid samples with flow_heun
    "accelerate launch scripts/train.py --config configs/cifar10_uvic_flow.py":
        Run(CIFAR10_MODEL + TRAIN, ("cifar10",), "a training run", trained_by_flow_matching),
    "accelerate launch --multi_gpu --num_processes 4 --mixed_precision fp16 "
    "scripts/train.py --config configs/cifar10_uvit.py":
        NotHere(ACCELERATE_GPUS.format(n=4), CIFAR10_MODEL + TRAIN),
    "accelerate launch scripts/train.py --config configs/cifar10_uvic.py --resume latest":
        Run(CIFAR10_MODEL + TRAIN + sets("train.max_steps=4"), ("cifar10", "cifar10 runs"),
            "a training run", resumed),
    "accelerate launch scripts/train.py --config configs/cifar10_uvic.py "
    "--resume latest-intact":
        Run(CIFAR10_MODEL + TRAIN + sets("train.max_steps=4"), ("cifar10", "cifar10 runs"),
            "a training run", resumed),
    "accelerate launch scripts/train.py --config configs/cifar10_uvic.py --overwrite":
        Run(CIFAR10_MODEL + TRAIN, ("cifar10", "cifar10 runs"), "a training run",
            started_over),
    # on the CPU, tiny local VAE and CLIP weights (the README's offline options), 64 px
    "python scripts/extract_mscoco_features.py --coco data/coco --out data/mscoco_features "
    "--device cuda":
        Run(("--device", "cpu", "--vae", "{assets}/vae", "--clip-model",
             "local-dir:{assets}/clip", "--clip-pretrained", "", "--resolution", "64",
             "--workers", "0", "--no-progress"), ("coco",), check=features_complete),
    # on the CPU with the tiny local VAE, 64 px crops (8x8 latents) of a tiny ImageNet
    "python scripts/extract_imagenet_features.py --imagenet data/imagenet --out "
    "data/imagenet256_features --resolution 256":
        Run(IMAGENET_OFFLINE, ("imagenet",), check=imagenet_features_complete(256)),
    "python scripts/extract_imagenet_features.py --imagenet data/imagenet --out "
    "data/imagenet512_features --resolution 512":
        Run(IMAGENET_OFFLINE, ("imagenet",), check=imagenet_features_complete(512)),
    "accelerate launch --multi_gpu --num_processes 4 --mixed_precision fp16 "
    "scripts/train.py --config configs/mscoco_uvic.py":
        NotHere(ACCELERATE_GPUS.format(n=4), MSCOCO_MODEL + MSCOCO_OFFLINE + TRAIN),
    "python scripts/sample.py --config configs/cifar10_uvic.py --ckpt "
    "runs/cifar10_uvic/ema.safetensors --n 64 --out samples/":
        Run(CIFAR10_MODEL + SAMPLE, ("cifar10 runs",), "samples"),
    "python scripts/sample.py --config configs/cifar10_uvic.py --ckpt "
    "runs/cifar10_uvic/ema.safetensors --scheduler dpm_solver++ --steps 50 --n 64 "
    "--out samples/fast": Run(CIFAR10_MODEL + SAMPLE, ("cifar10 runs",), "samples"),
    "python scripts/sample.py --config configs/mscoco_uvic.py --ckpt "
    "runs/mscoco_uvic/ema.safetensors --prompts prompts.txt --cfg-scale 1.0 "
    "--out samples/coco":
        Run(MSCOCO_MODEL + MSCOCO_OFFLINE + SAMPLE, ("mscoco run", "prompts"), "samples"),
    # --n 4 (SAMPLE) for 8 ids: one image of each
    "python scripts/sample.py --config configs/imagenet256_uvit_large.py --ckpt "
    "imagenet256_uvit_large.pth --class-labels 207,360,387,974,88,979,417,279 "
    "--out samples/imagenet256":
        Run(IMAGENET256_MODEL + IMAGENET_VAE + SAMPLE, ("imagenet256 checkpoint",), "samples",
            shows_classes(207, 360, 387, 974, 88, 979, 417, 279)),
    "python scripts/sample.py --config configs/quickstart.py --ckpt "
    "runs/quickstart/uvit/ema.safetensors --ckpt runs/quickstart/uvic/ema.safetensors "
    "--label U-ViT --label U-ViC --out samples/compare":
        Run((*sets(f"sample.autoguidance_ckpt={GUIDE}"), *SAMPLE), ("quickstart runs",),
            check=writes("samples/compare/grid.png", "samples/compare/grid_U-ViC.png",
                         "samples/compare/sample_config.json")),
    "python scripts/sample.py --config configs/imagenet256_uvit_large.py --ckpt "
    "imagenet256_uvit_large.pth --class-labels 207,360,387,974 "
    "--set sample.guidance_interval=0,2.33 --out samples/interval":
        Run(IMAGENET256_MODEL + IMAGENET_VAE + SAMPLE, ("imagenet256 checkpoint",), "samples"),
    "accelerate launch scripts/train.py --config configs/cifar10_uvic.py "
    "--set 'train.keep_steps=[50000]'":
        Run(CIFAR10_MODEL + TRAIN + sets("train.keep_steps=[1]"), ("cifar10",),
            "a training run", keeps_step_1),
    "python scripts/sample.py --config configs/cifar10_uvic.py --ckpt "
    "runs/cifar10_uvic/ema.safetensors --set sample.autoguidance_scale=1.0 "
    "--set sample.autoguidance_ckpt=checkpoints/step_050000/ema.safetensors --out samples/ag":
        Run(CIFAR10_MODEL + SAMPLE + sets(f"sample.autoguidance_ckpt={GUIDE}"),
            ("cifar10 runs",), "samples"),
    "accelerate launch eval/fid.py --config configs/cifar10_uvic.py --ckpt "
    "runs/cifar10_uvic/ema.safetensors --out runs/fid/cifar10_uvic.json":
        NotHere(INCEPTION, CIFAR10_MODEL),
    "python eval/fid_table.py runs/fid --out runs/fid/table.md":
        Run(needs=("fid results",), check=writes("runs/fid/table.md")),
    "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 scripts/train.py "
    "--config configs/quickstart.py --output-dir runs/cpu2": Elsewhere("tests/test_train.py"),
    "python eval/fid.py --config runs/cifar10_uvic/config.json --ckpt "
    "runs/cifar10_uvic/ema.safetensors --features projection --n 1000 "
    "--out runs/fid/cifar10_uvic_projection.json":
        Run(("--n", "4", "--steps", "2"), ("cifar10", "cifar10 runs"),
            check=writes("runs/fid/cifar10_uvic_projection.json")),
    "accelerate launch eval/fid.py --config configs/cifar10_uvic.py --ckpt "
    "runs/cifar10_uvic/ema.safetensors --metrics fid,fd_dinov2,precision_recall "
    "--dinov2-path dinov2_vitl14_pretrain.pth --out runs/fid/cifar10_uvic_dinov2.json":
        NotHere(INCEPTION + " and the DINOv2 ViT-L/14 weights (a download; "
                "tests/test_fd_dinov2.py runs it on a tiny DINOv2)", CIFAR10_MODEL),
    "python scripts/reproduce_table3.py --dry-run":
        Run(check=plan_states_the_readme_compute),
    "accelerate launch --multi_gpu --num_processes 8 scripts/reproduce_table3.py "
    "--out runs/table3": NotHere(ACCELERATE_GPUS.format(n=8) + " and " + INCEPTION),
    "python scripts/reproduce_table3.py --smoke":
        Run(check=writes("runs/table3_smoke/table3.md")),
    "accelerate launch --multi_gpu --num_processes 8 --mixed_precision fp16 scripts/train.py "
    "--config configs/imagenet256_uvic_huge.py": NotHere(ACCELERATE_GPUS.format(n=8), TRAIN),
    "accelerate launch --multi_gpu --num_processes 8 --mixed_precision fp16 scripts/train.py "
    "--config configs/imagenet64_uvic_mid.py": NotHere(ACCELERATE_GPUS.format(n=8), TRAIN),
    "accelerate launch --multi_gpu --num_processes 4 --mixed_precision fp16 scripts/train.py "
    "--config configs/celeba64_uvic_small.py": NotHere(ACCELERATE_GPUS.format(n=4), TRAIN),
    "accelerate launch --multi_gpu --num_processes 8 eval/fid.py --config "
    "configs/imagenet256_uvic_huge.py --ckpt runs/imagenet256_uvic_huge/ema.safetensors "
    "--out runs/fid/imagenet256_uvic_huge.json":
        NotHere(ACCELERATE_GPUS.format(n=8) + ", " + INCEPTION + ", a trained ImageNet model"),
    "accelerate launch eval/fid.py --config configs/celeba64_uvic_small.py --ckpt "
    "runs/celeba64_uvic_small/ema.safetensors --set "
    "eval.ref_stats=assets/fid_stats/fid_stats_celeba64_train_50000_ddim.npz "
    "--out runs/fid/celeba64_uvic_small.json":
        NotHere(INCEPTION + ", the release's CelebA statistics and a trained CelebA model"),
    # the release table's runner is Table 3's; its smoke is tests/test_release_table.py's too
    "python scripts/reproduce_release_table.py --dry-run":
        Run(check=plan_states_the_release_compute),
    "accelerate launch --multi_gpu --num_processes 8 scripts/reproduce_release_table.py "
    "--only imagenet256_huge": NotHere(ACCELERATE_GPUS.format(n=8) + " and " + INCEPTION),
    "python scripts/reproduce_release_table.py --smoke":
        Run(check=writes("runs/release_table_smoke/release_table.md")),
    # the modern-recipe table: tests/test_recipes_table.py runs both (docs/recipes.md)
    "python scripts/reproduce_recipes_table.py --dry-run": Elsewhere("tests/test_recipes_table.py"),
    "python scripts/reproduce_recipes_table.py --smoke": Elsewhere("tests/test_recipes_table.py"),
    "python scripts/extract_imagenet_features.py --imagenet data/imagenet --out "
    "data/imagenet256_features_repa --resolution 256 --repa-encoder "
    "vit_base_patch14_dinov2.lvd142m":
        NotHere("it needs ImageNet and DINOv2-B's weights (timm's hub); tests/test_repa.py "
                "extracts with a tiny random encoder"),
    "python scripts/compare.py --dry-run --steps 1500,2100 --set eval.n_samples=128":
        Elsewhere("tests/test_compare.py"),
    "python scripts/compare.py --steps 1500,2100 --best --set eval.n_samples=128":
        Elsewhere("tests/test_compare.py"),
    # docs/comparisons.md: every design and the two controls (the runner at reduced size:
    # tests/test_compare.py; the designs' training: tests/test_designs.py)
    "python scripts/compare.py --steps 1500,2100 --best --set eval.n_samples=128 "
    "--variants uvit,uvic,uvie,uvis,uvid,uvid2,uvit_gate,uvic_gate "
    "--variant \"uvit_gate:model.attention=uvit;model.output_gate=elementwise\" "
    "--variant \"uvic_gate:model.attention=uvic;model.output_gate=elementwise\" "
    "--out runs/compare_designs":
        Elsewhere("tests/test_compare.py"),
    # docs/recipes.md: U-ViT vs U-ViC under flow matching
    "python scripts/compare.py --variants uvit,uvic --set eval.n_samples=128 "
    "--set diffusion.objective=velocity --set diffusion.min_snr_gamma=0 "
    "--set sample.scheduler=flow_heun --set sample.steps=25 "
    "--set train.max_steps=1200 --set 'train.keep_steps=[500]' "
    "--set sample.autoguidance_ckpt=checkpoints/step_000500/ema.safetensors "
    "--threads 1 --out runs/flowcmp":
        Elsewhere("tests/test_compare.py"),
    "accelerate launch eval/fid.py --config configs/cifar10_uvit.py --ckpt "
    "cifar10_uvit_small.pth --out runs/fid/release/cifar10_uvit.json":
        NotHere(INCEPTION, CIFAR10_MODEL),
    "accelerate launch eval/fid.py --config configs/mscoco_uvit.py --ckpt "
    "mscoco_uvit_small.pth --out runs/fid/release/mscoco_uvit.json":
        NotHere(INCEPTION + ", COCO val2014 images", MSCOCO_MODEL + MSCOCO_OFFLINE),
    "python eval/fid_table.py runs/fid/release": Run(needs=("fid results",)),
    "python scripts/sample.py --config configs/cifar10_uvit.py --ckpt "
    "cifar10_uvit_small.pth --out samples/release":
        Run(CIFAR10_MODEL + SAMPLE, ("release checkpoint",), "samples"),
    "python scripts/analyze_attention.py --config configs/cifar10_uvic.py "
    "U-ViT=runs/cifar10_uvit/ema.safetensors U-ViC=runs/cifar10_uvic/ema.safetensors "
    "--num-images 8 --levels 5 --out runs/analysis/cifar10":
        Run((*CIFAR10_MODEL, "--num-images", "2", "--levels", "2"),
            ("cifar10", "cifar10 runs"), check=writes("runs/analysis/cifar10/attention.json")),
    "python scripts/gated_attention.py capacity --dry-run --out runs/gated/capacity":
        Run(("--modes", "softmax", "--heads", "1", "--max-trigrams", "1", "--max-steps",
             "100"), check=states_the_gated_compute),
    "python scripts/gated_attention.py capacity --workers 2 --out runs/gated/capacity":
        Run(("--modes", "softmax,cog", "--heads", "1", "--seeds", "2", "--max-trigrams", "1",
             "--max-steps", "100", "--lr", "0.1", "--init-std", "0.02", "--workers", "1"),
            check=writes("runs/gated/capacity/capacity.json", "runs/gated/capacity/capacity.md",
                         "runs/gated/capacity/capacity.png",
                         "runs/gated/capacity/models.jsonl")),
    "python scripts/gated_attention.py sensitivity --modes softmax,cog --heads 1 "
    "--max-trigrams 4 --workers 2 --out runs/gated/sensitivity":
        Run(("--heads", "1", "--seeds", "2", "--max-trigrams", "1", "--max-steps", "100",
             "--workers", "1"),
            check=writes("runs/gated/sensitivity/sensitivity.json",
                         "runs/gated/sensitivity/sensitivity.md")),
    "python scripts/gated_attention.py copy-suppress --workers 2 --out runs/gated/copy_suppress":
        Run(("--modes", "cog", "--heads", "1", "--seeds", "1", "--group", "2", "--lr", "0.1",
             "--init-std", "0.02", "--max-steps", "100", "--workers", "1"),
            check=writes("runs/gated/copy_suppress/copy_suppress.json",
                         "runs/gated/copy_suppress/copy_suppress.md")),
    "python scripts/gated_attention.py capacity --modes softmax,cog,differential,softmax+gate,"
    "cog+gate --heads 1,2 --max-trigrams 7 --workers 2 --out runs/gated/capacity_controls":
        Run(("--modes", "softmax,differential,cog+gate", "--seeds", "1", "--max-trigrams", "1",
             "--max-steps", "10", "--lr", "0.1", "--init-std", "0.02", "--workers", "1"),
            check=shows_the_absent_cell("runs/gated/capacity_controls/capacity.md")),
    "python scripts/gated_attention.py copy-suppress --modes softmax,cog,differential,"
    "softmax+gate,cog+gate --heads 1,2 --workers 2 --out runs/gated/copy_suppress_controls":
        Run(("--modes", "softmax,differential,cog+gate", "--seeds", "1", "--group", "2",
             "--lr", "0.1", "--init-std", "0.02", "--max-steps", "10", "--workers", "1"),
            check=shows_the_absent_cell("runs/gated/copy_suppress_controls/copy_suppress.md")),
    'make test ARGS="tests/test_kernels.py -x"':
        NotHere("a part of the test suite itself (make test runs it all)"),
    "TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_kernels.py":
        NotHere("a part of the test suite itself (make test runs it all)"),
    "accelerate config": NotHere("Accelerate's own interactive setup (it asks questions)"),
    "make install": NotHere("it built the environment these tests run in"),
    "make lock": NotHere("it resolves every dependency afresh from the package index (a new "
                         "virtual environment, the network); tests/test_lock.py checks what "
                         "it writes"),
    'make quickstart ARGS="--threads 1"': Elsewhere("tests/test_quickstart.py"),
    'make quickstart ARGS="--set train.max_steps=5400"':
        NotHere("the full-size quickstart with twice the training (about 10 minutes; "
                "tests/test_quickstart.py runs it at a reduced size)",
                check=quickstart_config_is_valid(
                    'make quickstart ARGS="--set train.max_steps=5400"')),
    "python scripts/export.py runs/cifar10_uvic --out exported/cifar10_uvic":
        Run(needs=("cifar10 runs",), check=exported("exported/cifar10_uvic", 32)),
    "python scripts/export.py runs/mscoco_uvic --out exported/mscoco_uvic":
        Run(needs=("mscoco run",), check=exported("exported/mscoco_uvic", 64, prompt="a bus")),
    "python scripts/export.py cifar10_uvit_small.pth --config configs/cifar10_uvit.py "
    "--out exported/cifar10_uvit_release":
        Run(CIFAR10_MODEL, ("release checkpoint",),
            check=exported("exported/cifar10_uvit_release", 32)),
    "python tests/test_samplers.py": Run(check=samplers_print_the_readme_figures),
    # post-hoc EMA (docs/training.md): a tiny run, its reconstruction and samples of it
    "python scripts/train.py --config configs/quickstart.py "
    "--set train.posthoc_ema_stds=0.05,0.1 --set train.posthoc_ema_every=100 "
    "--output-dir runs/quickstart_phema": Elsewhere("tests/test_posthoc_ema.py"),
    "python scripts/posthoc_ema.py runs/quickstart_phema --sigma-rel 0.08 "
    "--out runs/quickstart_phema/phema_0.080": Elsewhere("tests/test_posthoc_ema.py"),
    "python scripts/sample.py --config runs/quickstart_phema/phema_0.080/config.json "
    "--ckpt runs/quickstart_phema/phema_0.080/ema.safetensors --out samples/quickstart_phema":
        Elsewhere("tests/test_posthoc_ema.py"),
    "make bench": Run(("--smoke",), check=writes("runs/bench/kernels.json")),
    "python -m uvic_kernels.bench": Same("make bench"),
    "python scripts/bench_train.py": Run(("--smoke",), check=writes("runs/bench/train.json")),
    "make gpu-check": Run(("--smoke", "--budget-s", "8"),
                          check=writes("runs/bench/gpu-check.json")),
    "python -m uvic.cli.gpu_check": Same("make gpu-check"),
}


# --------------------------------------------------------------------------- what runs need


class Assets:
    """What the commands need, made once per session on first use, in the real formats:
    generated data (tests/datagen.py), tiny local VAE and CLIP weights, and tiny runs of
    the real training loop with the settings the commands add (`place` copies them into
    a command's folder, where the command finds them under the README's paths)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: set[str] = set()

    def place(self, need: str, ws: Path) -> None:
        getattr(self, "make_" + need.replace(" ", "_"))()
        for source, target in PLACES[need]:
            source, target = self.root / source, ws / target
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir() and source.name in ("cifar10", "coco", "features", "imagenet"):
                target.symlink_to(source)  # read-only data
            elif source.is_dir():
                shutil.copytree(source, target)  # runs: commands resume and overwrite them
            else:
                shutil.copyfile(source, target)

    def once(self, need: str) -> bool:
        """True the first time only: make `need` now."""
        first = need not in self.made
        self.made.add(need)
        return first

    def make_cifar10(self) -> None:
        if self.once("cifar10"):
            make_cifar10(self.root / "cifar10")

    def make_models(self) -> None:
        if not (self.root / "vae").exists():
            tiny_vae_folder(self.root / "vae")
            tiny_clip_folder(self.root / "clip")

    def make_imagenet(self) -> None:
        if self.once("imagenet"):
            self.make_models()
            make_imagenet(self.root / "imagenet")

    def make_coco(self) -> None:
        if self.once("coco"):
            self.make_models()
            make_coco(self.root / "coco", {"train": 3, "val": 2})

    def train(self, config: str, name: str, *overrides: str) -> None:
        cfg = load_config(ROOT / "configs" / config, [
            *overrides, f"train.output_dir={self.root / 'runs' / name}",
            f"train.keep_steps=[{GUIDE_STEP}]"])
        try:
            from uvic.training.trainer import train

            train(cfg)
        finally:  # Accelerate's process-wide singletons, for the next run
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()

    def make_cifar10_runs(self) -> None:
        if self.once("cifar10 runs"):
            self.make_cifar10()
            extra = [*set_values(CIFAR10_MODEL + TRAIN), f"data.root={self.root / 'cifar10'}"]
            with fake_cifar10_checksums(self.root / "cifar10"):
                self.train("cifar10_uvic.py", "cifar10_uvic", *extra)
                self.train("cifar10_uvit.py", "cifar10_uvit", *extra)

    def make_mscoco_run(self) -> None:
        if self.once("mscoco run"):
            self.make_models()
            features = make_mscoco_features(self.root / "mscoco", {"train": 4, "val": 2})
            (self.root / "features").symlink_to(features)
            offline = [o.replace("{assets}", str(self.root)) for o in set_values(MSCOCO_OFFLINE)]
            self.train("mscoco_uvic.py", "mscoco_uvic", *set_values(MSCOCO_MODEL + TRAIN),
                       *offline, f"data.root={features}")

    def make_quickstart_runs(self) -> None:
        if self.once("quickstart runs"):
            for preset in ("uvit", "uvic"):
                self.train("quickstart.py", f"quickstart/{preset}", f"model.attention={preset}",
                           "model.attention_backend=torch", "train.max_steps=2",
                           "sample.autoguidance_scale=0",
                           "data.num_images=64")

    def make_prompts(self) -> None:
        (self.root / "prompts.txt").write_text("a red bus\n\na dog on a surfboard\n")

    def make_release_checkpoint(self) -> None:
        if self.once("release checkpoint"):
            cfg = load_config(ROOT / "configs/cifar10_uvit.py", set_values(CIFAR10_MODEL))
            torch.manual_seed(0)
            torch.save(build_model(cfg.model).state_dict(), self.root / "cifar10_uvit_small.pth")

    def make_imagenet256_checkpoint(self) -> None:
        """A release-format nnet_ema.pth (random weights) of the tiny ImageNet-256 L/2."""
        if self.once("imagenet256 checkpoint"):
            self.make_models()
            cfg = load_config(ROOT / "configs/imagenet256_uvit_large.py",
                              set_values(IMAGENET256_MODEL))
            torch.manual_seed(0)
            torch.save(build_model(cfg.model).state_dict(),
                       self.root / "imagenet256_uvit_large.pth")

    def make_fid_results(self) -> None:
        """A result JSON of the real evaluator, with its stand-in features (no Inception)."""
        if self.once("fid results"):
            from uvic.evaluation import fid
            from uvic.evaluation import statistics as fid_stats

            self.make_cifar10_runs()
            ref = save_shapes_folder(self.root / "ref", 8, size=32)
            cfg = load_config(ROOT / "configs/cifar10_uvic.py", [
                *set_values(CIFAR10_MODEL), "sample.steps=2", "sample.batch_size=4",
                f"eval.ref_images={ref}"])
            fid.evaluate(apply_overrides(cfg, ["eval.n_samples=4"]),
                         self.root / "runs/cifar10_uvic/ema.safetensors",
                         out_json=self.root / "fid/cifar10_uvic.json",
                         feat_extractor=fid_stats.ProjectionFeatures("tiny16"),
                         stats_dir=self.root / "stats", num_workers=0, progress=False)


# need -> (asset, path in the command's folder) pairs
PLACES: dict[str, list[tuple[str, str]]] = {
    "cifar10": [("cifar10", "data/cifar10")],
    "coco": [("coco", "data/coco")],
    "imagenet": [("imagenet", "data/imagenet")],
    "cifar10 runs": [("runs/cifar10_uvic", "runs/cifar10_uvic"),
                     ("runs/cifar10_uvit", "runs/cifar10_uvit")],
    "mscoco run": [("features", "data/mscoco_features"), ("runs/mscoco_uvic", "runs/mscoco_uvic")],
    "quickstart runs": [("runs/quickstart", "runs/quickstart")],
    "prompts": [("prompts.txt", "prompts.txt")],
    "release checkpoint": [("cifar10_uvit_small.pth", "cifar10_uvit_small.pth")],
    "imagenet256 checkpoint": [("imagenet256_uvit_large.pth", "imagenet256_uvit_large.pth")],
    # one result JSON of the evaluator, in both folders the README tabulates
    "fid results": [("fid/cifar10_uvic.json", "runs/fid/cifar10_uvic.json"),
                    ("fid/cifar10_uvic.json", "runs/fid/release/cifar10_uvic.json")],
}


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    return Assets(tmp_path_factory.mktemp("readme_assets"))


def run_command(command: str, entry: Run, ws: Path, assets: Assets
                ) -> tuple[list[str], subprocess.CompletedProcess]:
    """Run a README command with its entry's additions in folder `ws`, in a clean
    environment (no TRITON_INTERPRET from conftest.py, no user config)."""
    for need in entry.needs:
        assets.place(need, ws)
    env_words, words = command_line(command)
    words += [w.replace("{assets}", str(assets.root)) for w in entry.add]
    env = {"PATH": f"{VENV / 'bin'}:/usr/bin:/bin", "HOME": str(ws), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", **env_words}
    pythonpath = [os.environ["PYTHONPATH"]] if "PYTHONPATH" in os.environ else []
    if "cifar10" in entry.needs:
        pythonpath.insert(0, str(SHIMS))
        env["UVIC_TEST_CIFAR10_ROOT"] = str(assets.root / "cifar10")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    proc = subprocess.run(words, cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    return words, proc


# --------------------------------------------------------------------------- the commands


def test_every_readme_command_has_an_entry() -> None:
    commands = readme_commands()
    missing = [c for c in commands if c not in COMMANDS]
    assert not missing, f"documented commands without an entry in COMMANDS: {missing}"
    stale = [c for c in COMMANDS if c not in commands]
    assert not stale, f"COMMANDS entries no page has any more: {stale}"


def test_readme_opens_with_the_two_setup_commands() -> None:
    assert readme_commands(README)[:2] == ["make quickstart", "make test"]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M)


def test_make_targets_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.M))
    for command in readme_commands():
        if command.startswith("make "):
            assert command.split()[1] in targets, command


def test_make_commands_ignore_an_enclosing_make(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `make test ARGS="--durations=12"` the suite's environment is what that make
    gives its recipe (here: a make run with that ARGS, its environment read back); the
    README's make commands run by the tests still run their own recipe, not with ARGS."""
    makefile = tmp_path / "Makefile"
    makefile.write_text("all:\n\t@env -0\n")
    proc = subprocess.run(["make", "-s", "-f", str(makefile), "ARGS=--durations=12"],
                          capture_output=True, text=True, timeout=60)
    inherited = dict(v.split("=", 1) for v in proc.stdout.split("\0") if "=" in v)
    assert "ARGS=--durations=12" in inherited["MAKEFLAGS"], inherited.get("MAKEFLAGS")
    for name, value in inherited.items():
        if name.startswith(("MAKE", "MFLAGS")) or name == "ARGS":
            monkeypatch.setenv(name, value)
    for command in ("make quickstart", "make bench", 'make quickstart ARGS="--threads 1"'):
        words = command_line(command)[1]
        assert not any("--durations" in w for w in words), (command, words)
    assert command_line('make quickstart ARGS="--threads 1"')[1][-2:] == ["--threads", "1"]


class Parsed(Exception):
    """Raised in place of a script's work once its parser has read the arguments."""


def parse_only(main: Callable[[list[str]], object], args: list[str]) -> argparse.ArgumentParser:
    """Let `main` parse `args` with its own parser, then stop it; returns the parser."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop):
        try:
            main(args)
        except Parsed as parsed:
            return parsed.args[0]
    raise AssertionError("the program never parsed its arguments")


def script_of(words: list[str]) -> tuple[Callable | None, list[str], list[str]]:
    """(the program's main, launcher words, program arguments) of a command's argv."""
    launcher: list[str] = []
    if Path(words[0]).name == "accelerate" and words[1] != "launch":
        return None, [], words[1:]  # Accelerate's own commands
    if Path(words[0]).name == "accelerate":
        parser_words = words[2:]
        script = next(i for i, w in enumerate(parser_words) if w.endswith(".py"))
        launcher, words = parser_words[:script], ["python", *parser_words[script:]]
    if words[1] == "-m":
        module = __import__(words[2], fromlist=["main"])
        return getattr(module, "main", None), launcher, words[3:]
    if words[1].startswith(str(ROOT / "scripts")) or words[1].startswith(str(ROOT / "eval")):
        return runpy.run_path(words[1], run_name="readme_check").get("main"), launcher, words[2:]
    return None, launcher, words[1:]


# the commands of a program (not make's own, nor the test suite's)
PROGRAMS = [c for c in COMMANDS
            if not re.match(r"make (test|install|lock)\b|\w+=\S+ \S+ -m pytest", c)]


@pytest.mark.parametrize("command", PROGRAMS, ids=short)
def test_command_flags_and_config_are_valid(command: str) -> None:
    """Every command's launcher flags and program flags parse, and its config with the
    README's `--set` values (and the entry's additions) validates: for a command that
    cannot run here, all that can be checked."""
    add = getattr(COMMANDS[command], "add", ())
    _, words = command_line(command)
    main, launcher, args = script_of(words)
    if launcher:
        from accelerate.commands.launch import launch_command_parser

        launch_command_parser().parse_args([*launcher, "script.py"])
    if main is not None:
        parse_only(main, args)
    config = option(args, "--config")
    if config is not None and not config.startswith("runs/"):  # a run's: checked by running
        add = [w.replace("{assets}", "/tmp") for w in add]
        validate(load_config(config, set_values(args) + set_values(add)))


@pytest.mark.parametrize("command", [c for c, e in COMMANDS.items() if isinstance(e, NotHere)])
def test_commands_that_cannot_run_here_say_why(command: str) -> None:
    entry = COMMANDS[command]
    assert entry.why
    if entry.check is not None:
        entry.check()


def test_flags_named_in_the_prose_exist() -> None:
    """Options the prose names (`--threads 1`, `--mode clean`, `--set key=value`) are
    options of a README program or of `accelerate launch`, and config keys."""
    from accelerate.commands.launch import launch_command_parser

    parsers = [launch_command_parser()]
    for command in PROGRAMS:
        main, _, args = script_of(command_line(command)[1])
        if main is not None:
            parsers.append(parse_only(main, args))
    flags = {flag for parser in with_subcommands(parsers)
             for flag in parser._option_string_actions}
    keys = config_keys()
    spans = [span for name in PAGES for span in re.findall(r"`(--[^`]+)`", page(name))]
    assert spans
    for span in spans:
        words = shlex.split(span)
        for i, word in enumerate(words):
            if word.startswith("--"):
                assert word.split("=")[0] in flags, f"no program has the option {word} ({span})"
            if i and words[i - 1] == "--set" and not word.startswith("section."):
                assert word.split("=")[0] in keys, f"no config key {word} ({span})"


def with_subcommands(parsers: list[argparse.ArgumentParser]) -> list[argparse.ArgumentParser]:
    """The parsers and, at any depth, those of their subcommands."""
    found, todo = [], list(parsers)
    while todo:
        parser = todo.pop()
        found.append(parser)
        todo += [sub for action in parser._actions
                 if isinstance(action, argparse._SubParsersAction)
                 for sub in action.choices.values()]
    return found


def config_keys() -> set[str]:
    """Every `section.field` a `--set` can name."""
    cfg = Config()
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return {f"{name}.{field.name}" for name, section in sections.items()
            if dataclasses.is_dataclass(section) for field in dataclasses.fields(section)}


def where_outputs_go(row: str) -> list[str]:
    """The names a row of docs/outputs.md's "Where outputs go" table lists after its colon."""
    line = re.search(rf"^\| {re.escape(row)} \| [^:|]*: (.+) \|$", page("docs/outputs.md"),
                     flags=re.M)
    assert line, f"no row {row!r} in docs/outputs.md's 'Where outputs go'"
    return re.findall(r"`([^`]+)`", line.group(1))


def check_outputs(row: str, folder: Path, readme_sets: list[str], add_sets: list[str]) -> None:
    """The folder holds every file the README's row names, and the config saved there has
    the README's own `--set` values (those the test's additions leave alone)."""
    for pattern in where_outputs_go(row):
        if "<" in pattern:  # per label, only when there are several: the entry's check
            continue
        assert list(folder.glob(pattern.rstrip("/"))), f"{folder} has no {pattern} ({row})"
    if row == "a training run":
        saved = load_config(folder / "config.json")
    else:
        saved = from_dict(json.loads((folder / "sample_config.json").read_text())["config"],
                          source="sample_config.json")
    ours = {o.split("=")[0] for o in add_sets}
    for override in readme_sets:
        key = override.split("=")[0]
        if key not in ours:
            section, field = key.split(".")
            assert (getattr(getattr(saved, section), field)
                    == getattr(getattr(apply_overrides(saved, [override]), section), field)), (
                f"{override} of the README did not reach {folder}")


RUNS = [c for c, e in COMMANDS.items() if isinstance(e, Run)]


@pytest.mark.slow
@pytest.mark.parametrize("command", RUNS, ids=short)
def test_readme_command_runs_at_tiny_scale(command: str, assets: Assets, tmp_path: Path) -> None:
    entry = COMMANDS[command]
    words, proc = run_command(command, entry, tmp_path, assets)
    assert proc.returncode == 0, (f"{shlex.join(words)}\nexit {proc.returncode}\n"
                                  f"{proc.stderr[-3000:]}")
    if entry.outputs is not None:
        cfg = load_config(option(words, "--config"), set_values(words))
        folder = (Path(cfg.train.output_dir) if entry.outputs == "a training run"
                  else Path(option(words, "--out")))
        check_outputs(entry.outputs, tmp_path / folder, set_values(split_env(
            shlex.split(command))[1]), set_values(entry.add))
    if entry.check is not None:
        entry.check(tmp_path, proc)


@pytest.mark.parametrize("command", [c for c, e in COMMANDS.items() if isinstance(e, Same)])
def test_same_commands_run_the_same(command: str) -> None:
    a, b = command_line(command), command_line(COMMANDS[command].command)
    assert a[0] == b[0] and a[1][1:] == b[1][1:]
    assert Path(a[1][0]).resolve() == Path(b[1][0]).resolve()


@pytest.mark.parametrize("command", [c for c, e in COMMANDS.items() if isinstance(e, Elsewhere)])
def test_commands_run_elsewhere_are_taken_from_the_readme(command: str) -> None:
    """The test file that runs the command names it as the README writes it (and reads it
    with `readme_commands.argv`, which fails when the README lost it)."""
    source = (ROOT / COMMANDS[command].test_file).read_text()
    source = re.sub(r'"\s*\n\s*"', "", source)  # adjacent string literals joined
    assert repr(command) in source or f'"{command}"' in source, command
    assert "readme_commands" in source


# --------------------------------------------------------------------------- the numbers


@cache
def config(name: str) -> Config:
    return load_config(ROOT / "configs" / f"{name}.py")


@cache
def quickstart_defaults() -> argparse.Namespace:
    from uvic.cli.quickstart import parse_args

    return parse_args([])


def gpu_preset() -> Config:
    return load_config(ROOT / "configs/quickstart_gpu.py")


def guide_step() -> int:
    return int(re.search(r"step_(\d+)", config("quickstart").sample.autoguidance_ckpt).group(1))


def tokens(name: str) -> int:
    m = config(name).model
    return (m.img_size // m.patch_size) ** 2 + 1 + (m.num_clip_token if m.clip_dim else 0)


def same_modes() -> str:
    modes = {config(n).eval.mode for n in ("cifar10_uvit", "mscoco_uvit")}
    return modes.pop() if len(modes) == 1 else f"differ: {modes}"


def paper_recipe(name: str) -> tuple:
    cfg = config(name)
    return cfg.train.ema_decay, cfg.train.seed, cfg.train.mixed_precision


@cache
def parameters(name: str) -> int:
    return sum(p.numel() for p in build_model(config(name).model).parameters())


QS, C10, COCO = "quickstart", "cifar10_uvit", "mscoco_uvit"


def noise_level(name: str, t: float) -> float:
    """EDM's sigma at time t of config `name`'s schedule."""
    from uvic.diffusion.guidance_interval import sigma_of_time
    from uvic.diffusion.schedule import Diffusion

    return sigma_of_time(Diffusion(config(name).diffusion), t)


def interval_passes() -> tuple[int, int, int, int]:
    """docs/sampling.md's count: guided and all evaluations of the ImageNet-256 L/2
    protocol under (0, 2.33], and the passes of B rows with and without the interval."""
    from uvic.diffusion.guidance_interval import guided_calls
    from uvic.diffusion.schedule import Diffusion

    cfg = config("imagenet256_uvit_large")
    s = cfg.sample
    guided, calls = guided_calls(Diffusion(cfg.diffusion), (0.0, 2.33), s.scheduler, s.steps,
                                 s.order, s.scheduler_kwargs)
    return guided, calls, calls + guided, 2 * calls
FLOW_RESULT = ROOT / "docs/recipes_flow_compare.json"  # docs/recipes.md's measured comparison
FLOW_METRICS = ("heldout_mse", "standin_fid", "hf_ratio", "palette_share", "shape_share")


@cache
def flow_result() -> dict:
    return json.loads(FLOW_RESULT.read_text())


def flow_cells(variant: str) -> tuple[str, ...]:
    """docs/recipes.md's row of `variant`: mean ± t half-width of each metric at the last
    step, as uvic-compare's report writes them, from the run's recorded summary."""
    from uvic.evaluation.paired import Interval, format_interval

    r = flow_result()
    step = str(r["grid"][-1])
    cells = []
    for metric in FLOW_METRICS:
        d = r["summary"][metric]["steps"][step]["variants"][variant]
        runs = [run["metrics"][step][metric] for run in r["runs"].values()
                if run["variant"] == variant]  # the summary is these runs' mean
        assert len(runs) == d["n"] == 3 and math.isclose(sum(runs) / 3, d["mean"], rel_tol=1e-9)
        cells.append(format_interval(Interval(d["mean"], d["half_width"], d["n"], d["sd"])))
    return tuple(cells)


def flow_pair(metric: str) -> tuple:
    """docs/recipes.md's paired difference uvic - uvit on `metric`: mean ± t half-width,
    paired t p, bootstrap interval and p, as written there."""
    from uvic.experiments.compare_report import _diff

    r = flow_result()
    (pair,) = r["summary"][metric]["steps"][str(r["grid"][-1])]["pairs"]
    assert (pair["a"], pair["b"]) == ("uvit", "uvic")
    return (_diff(pair), float(f"{pair['t_p']:.2g}"), float(f"{pair['bootstrap_low']:.3g}"),
            float(f"{pair['bootstrap_high']:.3g}"), float(f"{pair['bootstrap_p']:.2g}"))


def flow_calls() -> tuple[int, int, int]:
    """The steps and network calls of the flow comparison's sampler (the recorded config)."""
    from uvic.diffusion.samplers import model_calls
    from uvic.diffusion.schedule import Diffusion

    cfg = from_dict(flow_result()["config"])
    s = cfg.sample
    calls = model_calls(Diffusion(cfg.diffusion), s.scheduler, s.steps)
    return s.steps, calls, calls * (2 if s.autoguidance_scale else 1)


# Per tested page (`readme_commands.PAGES`): (a sentence of the page with its numbers as
# groups, what the code says they are). A figure in a page needs its claim here.
CLAIMS: dict[str, list[tuple[str, Callable[[], tuple]]]] = {
    "README.md": [
        (r"U-ViT-S/2, (\d+)M parameters", lambda: (round(parameters(C10) / 1e6),)),
        (r"torchvision downloads it into `([^`]+)/`", lambda: (config(C10).data.root,)),
    ],
    "docs/analysis.md": [
        (r"log (\d+) = ([\d.]+) would be uniform over the (\d+) patches and the time token",
         lambda: (tokens(QS), round(math.log(tokens(QS)), 2), tokens(QS) - 1)),
    ],
    "docs/configs.md": [
        (r"U-ViT-S/2: patch (\d+), width (\d+), depth (\d+), (\d+) heads; AdamW ([\d.e-]+), "
         r"weight decay ([\d.]+); EMA ([\d.]+)",
         lambda: (config(C10).model.patch_size, config(C10).model.embed_dim,
                  config(C10).model.depth, config(C10).model.num_heads, config(C10).optim.lr,
                  config(C10).optim.weight_decay, config(C10).train.ema_decay)),
    ],
    "docs/conventions.md": [
        (r"val2014 at (\d+)x\d+", lambda: (config(COCO).eval.ref_res,)),
        (r"U-ViT-S/2 has ([\d,]+) parameters \(CIFAR-10\) and ([\d,]+) \(MS-COCO\)",
         lambda: (parameters(C10), parameters(COCO))),
        (r"\| sampler \| `(\w+)`, (\d+) steps [^|]*\| `([\w+]+)`, (\d+) steps [^|]*guidance "
         r"`eps = c \+ ([\d.]+) \(c - u\)` \|",
         lambda: (config(C10).sample.scheduler, config(C10).sample.steps,
                  config(COCO).sample.scheduler, config(COCO).sample.steps,
                  config(COCO).sample.cfg_scale)),
        (r"\| AdamW betas \| \(([\d.]+), ([\d.]+)\) \| \(([\d.]+), ([\d.]+)\) \|",
         lambda: (*config(C10).optim.betas, *config(COCO).optim.betas)),
        (r"\| warm-up steps \| (\d+) \| (\d+) \|",
         lambda: (config(C10).optim.warmup_steps, config(COCO).optim.warmup_steps)),
        (r"\| batch / steps \| (\d+) / (\d+)k \| (\d+) / (\d+)M \|",
         lambda: (config(C10).train.batch_size, config(C10).train.max_steps // 1000,
                  config(COCO).train.batch_size, config(COCO).train.max_steps // 1_000_000)),
        (r"\| samples \| ([\d,]+) \| ([\d,]+), captions",
         lambda: (config(C10).eval.n_samples, config(COCO).eval.n_samples)),
    ],
    "docs/evaluation.md": [
        (r"\| sampler \| `(\w+)`, (\d+) steps \| `([\w+]+)`, (\d+) steps, guidance scale (\d+) \|",
         lambda: (config(C10).sample.scheduler, config(C10).sample.steps,
                  config(COCO).sample.scheduler, config(COCO).sample.steps,
                  config(COCO).sample.cfg_scale)),
        (r"\| samples \| ([\d,]+) \| ([\d,]+), captions",
         lambda: (config(C10).eval.n_samples, config(COCO).eval.n_samples)),
        (r"\| FID \| clean-fid `(\w+)` \(the release's pytorch-fid port\) \| (same) \|",
         lambda: (same_modes(), "same")),
        (r"val2014 at (\d+)x\d+", lambda: (config(COCO).eval.ref_res,)),
    ],
    "docs/fidelity.md": [
        (r"(?i:continuous VP) (?:schedule )?\(beta ([\d.]+) -> (\d+)\)",
         lambda: (config(C10).diffusion.beta_min, config(C10).diffusion.beta_max)),
        (r"Euler-Maruyama (\d+) steps \(CIFAR-10\) and DPM-Solver \"fast\" (\d+) steps with "
         r"`eps = c \+ ([\d.]+) \(c - u\)`",
         lambda: (config(C10).sample.steps, config(COCO).sample.steps,
                  config(COCO).sample.cfg_scale)),
        (r"EMA rate ([\d.]+), seed (\d+), (\w+) training", lambda: paper_recipe(C10)),
        (r"EMA rate ([\d.]+), seed (\d+), (\w+) training", lambda: paper_recipe(COCO)),
        (r"([\d,]+) / ([\d,]+) samples",
         lambda: (config(C10).eval.n_samples, config(COCO).eval.n_samples)),
    ],
    "docs/kernels.md": [
        (r"\((\d+) tokens on CIFAR-10, (\d+) on MS-COCO\)", lambda: (tokens(C10), tokens(COCO))),
    ],
    "docs/outputs.md": [
        (r"\| quickstart \| `([^`]+)/` \|", lambda: (quickstart_defaults().out,)),
    ],
    "docs/quickstart.md": [
        (r"(\d+) steps of (\d+) images per model \((\d+) tokens per image\)",
         lambda: (config(QS).train.max_steps, config(QS).train.batch_size, tokens(QS) - 1)),
        (r"then (\d+) (\w+) steps with autoguidance \(below\) for (\d+) images per model",
         lambda: (config(QS).sample.steps, config(QS).sample.scheduler.removesuffix("Scheduler"),
                  quickstart_defaults().n_quality)),
        (r"DDPM's ancestral sampler \(\d+ steps then, (\d+) now\)",
         lambda: (config(QS).sample.steps,)),
        (r"so the default \(step (\d+), s = ([\d.]+), (\d+) steps\)",
         lambda: (guide_step(), config(QS).sample.autoguidance_scale, config(QS).sample.steps)),
        (r"keeps its EMA weights at step (\d+) \(`train\.keep_steps=\((\d+),\)`\)",
         lambda: (guide_step(), *config(QS).train.keep_steps)),
        (r"`eps = g \+ ([\d.]+) \(g - b\)`", lambda: (config(QS).sample.autoguidance_scale,)),
        (r"here Min-SNR-(\d+) weighted", lambda: (config(QS).diffusion.min_snr_gamma,)),
        (r"training objective, Min-SNR-(\d+) weighted: see below",
         lambda: (config(QS).diffusion.min_snr_gamma,)),
        (r"`--preset gpu` \(`configs/quickstart_gpu.py`\) trains a larger model for (\d+) steps "
         r"on a GPU, (without) autoguidance",
         lambda: (gpu_preset().train.max_steps,
                  "without" if gpu_preset().sample.autoguidance_scale == 0 else "with")),
        (r"`diffusion\.min_snr_gamma=(\d+)`", lambda: (config(QS).diffusion.min_snr_gamma,)),
        (r"\((\d+)x(\d+), no download\)", lambda: (config(QS).model.img_size,) * 2),
        (r"\(`--threads`, default (\d+),", lambda: (quickstart_defaults().threads,)),
        (r"writes to `([^`]+)/`:", lambda: (quickstart_defaults().out,)),
    ],
    "docs/recipes.md": [
        (r"`flow_heun` with (\d+) steps \((\d+) network calls per image, against the release's "
         r"(\d+)-step Euler-Maruyama",
         lambda: (config("cifar10_uvic_flow").sample.steps,
                  2 * config("cifar10_uvic_flow").sample.steps - 1, config(C10).sample.steps)),
        (r"took (\d+) minutes on the 2-core machine", lambda: (flow_result()["wall_minutes"],)),
        (r"`flow_heun` with (\d+) steps: (\d+) network calls per model and (\d+) per image",
         flow_calls),
        (r"\| U-ViT \(`uvit`, softmax\) \| (\S+ ± \S+) \| (\S+ ± \S+) \| (\S+ ± \S+) \| "
         r"(\S+ ± \S+) \| (\S+ ± \S+) \|", lambda: flow_cells("uvit")),
        (r"\| U-ViC \(`uvic`, Cog\) \| (\S+ ± \S+) \| (\S+ ± \S+) \| (\S+ ± \S+) \| "
         r"(\S+ ± \S+) \| (\S+ ± \S+) \|", lambda: flow_cells("uvic")),
        *[(rf"\| {label} \| ([+-]\S+ ± \S+) \| ([\d.e-]+) \| \[(\S+), (\S+)\] \| ([\d.e-]+) \|",
           lambda m=metric: flow_pair(m))
          for metric, label in zip(FLOW_METRICS, (
              "held-out velocity MSE", "stand-in FID", "HF energy vs real", "palette share",
              "with a shape"), strict=True)],
    ],
    "docs/sampling.md": [
        (r"\(([\d.]+) for the COCO FID protocol\)", lambda: (config(COCO).sample.cfg_scale,)),
        (r"sqrt\(\(1 - a\) / a\): ([\d.]+) at t = 1, ([\d.]+) at t = 0.5",
         lambda: (round(noise_level(C10, 1.0), 1), round(noise_level(C10, 0.5), 2))),
        (r"betas \| ([\d.]+) at t = 1 \|", lambda: (round(noise_level(COCO, 1.0), 1),)),
        (r"REPA guides t <= ([\d.]+), sigma <= [\d.]+ / [\d.]+ = ([\d.]+)",
         lambda: (0.7, round(0.7 / 0.3, 2))),
        (r"scaled by ([\d.]+), as the ImageNet-256",
         lambda: (config("imagenet256_uvit_large").data.scale_factor,)),
        (r"`0,2.33` guides (\d+) of the (\d+) evaluations, so a batch of B runs (\d+) passes "
         r"of B rows instead of (\d+)", interval_passes),
    ],
    "docs/training.md": [
        (r"Put CIFAR-10 \(the python version\) at `([^`]+)/cifar-10-batches-py/`",
         lambda: (config(C10).data.root,)),
        (r"--coco (\S+) --out (\S+) --device", lambda: (
            str(Path(config(COCO).eval.ref_images).parent), config(COCO).data.root)),
        (r"global batch \((\d+) for CIFAR-10\)", lambda: (config(C10).train.batch_size,)),
        (r"(?i:continuous VP) (?:schedule )?\(beta ([\d.]+) -> (\d+)\)",
         lambda: (config(C10).diffusion.beta_min, config(C10).diffusion.beta_max)),
        (r"scaled by ([\d.]+)\)", lambda: (config(COCO).data.scale_factor,)),
        (r"discrete scaled-linear schedule, (\d+) steps",
         lambda: (config(COCO).diffusion.num_train_timesteps,)),
        (r"to the empty prompt with p = ([\d.]+)", lambda: (config(COCO).diffusion.p_uncond,)),
        (r"(\d+) x (\d+) token states",
         lambda: (config(COCO).model.num_clip_token, config(COCO).model.clip_dim)),
    ],
}


def same_value(text: str, value: object) -> bool:
    if isinstance(value, str):
        return text == value
    try:
        return float(text.replace(",", "")) == float(value)
    except ValueError:
        return False


@pytest.mark.parametrize("name, pattern, expected",
                         [(name, *c) for name, claims in CLAIMS.items() for c in claims],
                         ids=[f"{name}: {c[0]}" for name, claims in CLAIMS.items()
                              for c in claims])
def test_readme_numbers_are_the_codes(name: str, pattern: str,
                                      expected: Callable[[], tuple]) -> None:
    """Each page's numbers (`CLAIMS`) are the configs' and scripts'."""
    matches = list(re.finditer(pattern, flat(name)))
    assert matches, f"{name} no longer says {pattern!r}: update the claim"
    want = expected()
    for match in matches:
        assert len(match.groups()) == len(want)
        assert all(same_value(g, w) for g, w in zip(match.groups(), want, strict=True)), (
            f"{name}: {match.group(0)!r}; the code: {want}")


def test_claims_name_tested_pages() -> None:
    assert set(CLAIMS) <= set(PAGES), sorted(set(CLAIMS) - set(PAGES))


def test_sampler_table_names_each_configs_default() -> None:
    """docs/sampling.md's table's "default of" column: each config's sampler and step
    count."""
    rows = re.findall(r"^\| (.+?) \| .+ \| (.*) \|$", page("docs/sampling.md"), flags=re.M)
    claimed: dict[str, tuple[str, int]] = {}
    for name_cell, default_of in rows:
        name = re.match(r"`([^`]+)`", name_cell)
        named = re.findall(r"`configs/[^`]+`|the quickstart", default_of)
        claims = re.findall(r"(`configs/[^`]+`|the quickstart) \((?:`(\w+)`, )?(\d+) steps\)",
                            default_of)
        assert len(claims) == len(named), f"say the sampler and steps: {default_of!r}"
        for configs, scheduler, steps in claims:
            paths = (sorted((ROOT / "configs").glob(configs.strip("`").removeprefix("configs/")))
                     if configs.startswith("`") else [ROOT / "configs/quickstart.py"])
            assert paths, configs
            for path in paths:
                assert path.stem not in claimed, f"two defaults for {path.stem}"
                claimed[path.stem] = (scheduler or (name.group(1) if name else ""), int(steps))
    configs = {p.stem for p in (ROOT / "configs").glob("*.py")} - {"table3_smoke"}
    assert set(claimed) == configs, f"the table names defaults of {sorted(claimed)}"
    for stem, (scheduler, steps) in claimed.items():
        sample = config(stem).sample
        assert (sample.scheduler, sample.steps) == (scheduler, steps), stem


def test_where_outputs_go_names_what_the_code_writes() -> None:
    """The rows checked on the outputs of the commands run above exist and are parsed."""
    assert "config.json" in where_outputs_go("a training run")
    assert "grid.png" in where_outputs_go("samples")
    assert any(e.outputs == row for e in COMMANDS.values() if isinstance(e, Run)
               for row in ("a training run", "samples"))


def test_layout_lists_the_files() -> None:
    """A Layout row (docs/development.md) that names a folder's .py (or .md) files names
    all of them."""
    rows = re.findall(r"^\| `([\w/]+/)` \| (.+) \|$", section("docs/development.md",
                                                                 "## Layout"), flags=re.M)
    assert rows
    for folder, what in rows:
        for suffix in (".py", ".md"):
            named = set(re.findall(rf"`([\w]+{re.escape(suffix)})`", what))
            if named:
                present = {p.name for p in (ROOT / folder).glob(f"*{suffix}")} - {"__init__.py"}
                assert named == present, f"Layout {folder}: {sorted(named)}, has {sorted(present)}"


def headings(text: str) -> set[str]:
    """The anchors of a markdown text's headings (GitHub's: lower case, spaces to '-',
    punctuation dropped), code blocks left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("name", PAGES)
def test_links_reach_their_targets(name: str) -> None:
    """Every relative link of a page (`[text](target)`) names a file of the repository and,
    with `#anchor`, one of that page's headings."""
    text = re.sub(r"```.*?```", "", page(name), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / name).parent / path if path else ROOT / name
        assert file.exists(), f"{name}: link {target} names no file"
        if anchor:
            assert anchor in headings(file.read_text()), f"{name}: {target}: no such heading"


def test_readme_reads_on_to_every_page() -> None:
    """The README's "Read on" table links every page of docs/ (a new page gets a row)."""
    read_on = section("README.md", "## Read on")
    linked = set(re.findall(r"^\| \[[^\]]+\]\((docs/[^)]+\.md)\)", read_on, flags=re.M))
    assert linked == set(PAGES) - {"README.md"}, sorted(set(PAGES) ^ linked ^ {"README.md"})


def test_outputs_of_commands_are_ignored_by_git() -> None:
    """What a documented command writes (`--out`, `--output-dir`, relative to where it
    runs) is ignored by git, so following the docs in a checkout leaves it clean."""
    outputs = set()
    for command in readme_commands():
        words = split_env(shlex.split(command))[1]
        for flag in ("--out", "--output-dir"):
            value = option(words, flag)
            if value is not None:
                outputs.add(value.split("/")[0] + "/x")
    assert {"samples/x", "runs/x", "exported/x"} <= outputs, outputs
    proc = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *outputs],
                          capture_output=True, text=True, timeout=60)
    ignored = set(proc.stdout.split())
    assert ignored == outputs, f"not in .gitignore: {sorted(outputs - ignored)}"


def test_named_commands_are_installed() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    named = {n for name in PAGES for n in re.findall(r"`(uvic-[\w-]+)`", page(name))}
    assert named and named <= set(scripts), sorted(named - set(scripts))
