"""Config files hold the paper's hyper-parameters; overrides and JSON round trips are typed.

Expected values are the U-ViT release's (its configs and FID protocol; docs/conventions.md),
written out here independently of the config files.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from uvic.config import (
    Config,
    ConfigError,
    apply_overrides,
    from_dict,
    load_config,
    to_dict,
)
from uvic.config.validation import validate
from uvic.files import save_config
from uvic.models.uvit import build_model, resolve_attention
from uvic.presets import derive

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
NAMES = ["cifar10_uvit", "cifar10_uvic", "cifar10_uvis", "cifar10_uvid", "cifar10_uvid2",
         "mscoco_uvit",
         "mscoco_uvic", "mscoco_uvid",
         "quickstart", "cifar10_uvit_flow", "cifar10_uvic_flow", "imagenet256_uvit_large_flow",
         "imagenet256_uvic_large_flow"]

SHARED = {  # both paper configs (U-ViT-S/2)
    "model.patch_size": 2, "model.embed_dim": 512, "model.depth": 12, "model.num_heads": 8,
    "model.mlp_ratio": 4.0, "model.qkv_bias": False, "model.mlp_time_embed": False,
    "model.conv": True, "model.skip": True, "model.img_size": 32,
    "optim.lr": 2e-4, "optim.weight_decay": 0.03, "optim.grad_clip": 0.0,
    "optim.lr_schedule": "constant",
    "train.ema_decay": 0.9999, "train.seed": 1234, "train.mixed_precision": "fp16",
    "eval.mode": "legacy_pytorch",  # the release's pytorch-fid port
}
PAPER = {
    "cifar10": {
        **SHARED, "model.in_chans": 3, "model.num_classes": -1, "model.clip_dim": 0,
        "data.name": "cifar10", "data.root": "data/cifar10", "data.random_flip": True,
        "diffusion.schedule": "vp_continuous", "diffusion.beta_min": 0.1,
        "diffusion.beta_max": 20.0,
        "optim.betas": (0.99, 0.999), "optim.warmup_steps": 2500,
        "train.batch_size": 128, "train.max_steps": 500_000,
        "sample.cfg_scale": 0.0, "sample.scheduler": "euler_maruyama", "sample.steps": 1000,
        "eval.n_samples": 50_000, "eval.ref_stats": "cifar10", "eval.ref_split": "train",
        "eval.ref_res": 32,
    },
    "mscoco": {
        **SHARED, "model.in_chans": 4, "model.clip_dim": 768, "model.num_clip_token": 77,
        "model.num_classes": -1,
        "data.name": "mscoco", "data.root": "data/mscoco_features", "data.scale_factor": 0.23010,
        "diffusion.schedule": "scaled_linear", "diffusion.beta_start": 0.00085,
        "diffusion.beta_end": 0.012, "diffusion.num_train_timesteps": 1000,
        "diffusion.p_uncond": 0.1,
        "optim.betas": (0.9, 0.9), "optim.warmup_steps": 5000,
        "train.batch_size": 256, "train.max_steps": 1_000_000,
        "sample.scheduler": "dpm_solver++_fast_time_uniform", "sample.steps": 50,
        "sample.cfg_scale": 1.0, "sample.batch_size": 50,
        "eval.n_samples": 30_000, "eval.ref_res": 256,
    },
}


def get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


@pytest.mark.parametrize("name", NAMES)
def test_every_config_loads_and_builds(name: str) -> None:
    cfg = load_config(CONFIGS / f"{name}.py")
    assert isinstance(cfg, Config) and cfg.name == name
    assert cfg.train.output_dir == f"runs/{name}"
    resolve_attention(cfg.model.attention, cfg.model.depth)
    if name == "quickstart":  # the paper models are built in test_model.py
        model = build_model(cfg.model)
        assert sum(p.numel() for p in model.parameters()) < 1_000_000


@pytest.mark.parametrize("name", ["cifar10_uvit", "cifar10_uvic", "mscoco_uvit", "mscoco_uvic"])
def test_paper_hyperparameters(name: str) -> None:
    cfg = load_config(CONFIGS / f"{name}.py")
    expected = PAPER[name.split("_")[0]]
    wrong = {k: (get(cfg, k), v) for k, v in expected.items() if get(cfg, k) != v}
    assert wrong == {}
    assert cfg.model.attention == name.split("_")[1]


@pytest.mark.parametrize(("name", "inner"), [
    ("cifar10_uvic", "cog"), ("mscoco_uvic", "cog"), ("cifar10_uvis", "sigmoid"),
    ("cifar10_uvid", "differential"), ("mscoco_uvid", "differential"),
    ("cifar10_uvid2", "differential_v2")])
def test_each_design_differs_from_uvit_only_in_attention(name: str, inner: str) -> None:
    """U-ViC, U-ViS, U-ViD: their design where U-ViC has Cog, everything else U-ViT's (the
    sigmoid bias at -log N; the output gate one setting away on any of them)."""
    dataset, preset = name.split("_")
    uvit = load_config(CONFIGS / f"{dataset}_uvit.py")
    cfg = load_config(CONFIGS / f"{name}.py")
    same = dataclasses.replace(
        cfg, name=uvit.name,
        model=dataclasses.replace(cfg.model, attention="uvit"),
        train=dataclasses.replace(cfg.train, output_dir=uvit.train.output_dir),
    )
    assert same == uvit and cfg.model.attention == preset and cfg.model.sigmoid_bias is None
    modes = resolve_attention(cfg.model.attention, cfg.model.depth)
    assert modes == ["softmax"] + [inner] * 11 + ["softmax"]
    gated = apply_overrides(cfg, ["model.output_gate=headwise"])
    assert validate(gated).model.output_gate == "headwise"


def test_quickstart_is_small_and_cpu_friendly() -> None:
    cfg = load_config(CONFIGS / "quickstart.py")
    assert cfg.data.name == "shapes" and cfg.train.mixed_precision == "no"
    assert (cfg.model.img_size, cfg.model.in_chans) == (16, 3)
    # ~5 minutes on 2 cores: under 0.2M parameters, 64 tokens, at most ~90k training
    # images per model (2700 steps of 32 at ~90 ms, both models at once).
    assert sum(p.numel() for p in build_model(cfg).parameters()) < 200_000
    assert (cfg.model.img_size // cfg.model.patch_size) ** 2 == 64
    assert cfg.train.max_steps * cfg.train.batch_size <= 90_000
    assert cfg.optim.warmup_steps < cfg.train.max_steps
    # The ancestral sampler takes more steps than DPM-Solver, but a forward pass of 128
    # images costs about one training step of 32: 100 of them, ~4% of the training.
    assert cfg.eval.n_samples <= 1000 and cfg.sample.steps <= 100
    # The EMA must move within the run: its horizon 1/(1-decay) is below the step count.
    assert 1 / (1 - cfg.train.ema_decay) < cfg.train.max_steps


def test_overrides_parse_declared_types() -> None:
    base = load_config(CONFIGS / "cifar10_uvit.py")
    cfg = apply_overrides(base, [
        "train.batch_size=64", "train.max_steps=1_000", "optim.lr=1e-4",
        "model.qkv_bias=true", "train.compile=0", "optim.betas=(0.9, 0.95)",
        "model.attention=uvic", "name=my run",
    ])
    assert cfg.train.batch_size == 64 and cfg.train.max_steps == 1000
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.model.qkv_bias is True and cfg.train.compile is False
    assert cfg.optim.betas == (0.9, 0.95) and cfg.model.attention == "uvic"
    assert cfg.name == "my run"
    assert base.train.batch_size == 128 and base.model.attention == "uvit"  # not mutated
    # Overrides also apply through load_config, and the last one wins.
    cfg = load_config(CONFIGS / "quickstart.py", ["train.seed=1", "train.seed=7"])
    assert cfg.train.seed == 7


@pytest.mark.parametrize(("override", "needle"), [
    ("train.batchsize=64", "'train.batchsize'"),
    ("training.batch_size=64", "'training.batch_size'"),
    ("train.batch_size=abc", "'train.batch_size' expects int, got 'abc'"),
    ("train.batch_size=1.5", "'train.batch_size' expects int"),
    ("model.qkv_bias=maybe", "'model.qkv_bias' expects bool"),
    ("optim.lr=fast", "'optim.lr' expects float"),
    ("optim.betas=(0.9)", "'optim.betas'"),
    ("optim.betas=(0.9,x)", "'optim.betas'"),
    ("model=3", "'model' is a section"),
    ("train.batch_size", "must look like section.field=value"),
])
def test_bad_overrides_name_the_key(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        apply_overrides(Config(), [override])
    assert needle in str(err.value)


def test_bad_attention_override_fails_at_build() -> None:
    cfg = apply_overrides(Config(), ["model.depth=2", "model.attention=cog,cog"])
    with pytest.raises(ValueError, match="'cog,cog'"):
        build_model(cfg.model)
    cfg = apply_overrides(cfg, ["model.attention=cog,softmax,cog", "model.embed_dim=32",
                                "model.num_heads=2"])
    assert build_model(cfg.model).attention_modes == ["cog", "softmax", "cog"]


@pytest.mark.parametrize("name", NAMES)
def test_save_load_round_trip(name: str, tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / f"{name}.py")
    save_config(cfg, tmp_path / "run" / "config.json")
    back = load_config(tmp_path / "run" / "config.json")
    assert back == cfg and isinstance(back.optim.betas, tuple)
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == json.loads(
        json.dumps(to_dict(cfg)))
    assert list((tmp_path / "run").iterdir()) == [tmp_path / "run" / "config.json"]


def test_bad_json_and_files(tmp_path: Path) -> None:
    data = to_dict(Config())
    data["train"]["epochs"] = 3
    with pytest.raises(ConfigError, match=r"'train\.epochs'"):
        from_dict(data)
    data = to_dict(Config())
    data["train"]["batch_size"] = "64"
    with pytest.raises(ConfigError, match=r"train\.batch_size must be int"):
        from_dict(data)
    data = to_dict(Config())
    data["optim"]["betas"] = [0.9]
    with pytest.raises(ConfigError, match=r"optim\.betas must be a list of 2 values"):
        from_dict(data)
    assert from_dict({"optim": {"lr": 1}}).optim.lr == 1.0  # JSON ints are fine for floats

    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.py")
    (tmp_path / "empty.py").write_text("X = 1\n")
    with pytest.raises(ConfigError, match="defines no get_config"):
        load_config(tmp_path / "empty.py")
    (tmp_path / "wrong.py").write_text("def get_config():\n    return {}\n")
    with pytest.raises(ConfigError, match=r"must return uvic\.config\.Config"):
        load_config(tmp_path / "wrong.py")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path / "bad.json")
    (tmp_path / "c.yaml").write_text("a: 1\n")
    with pytest.raises(ConfigError, match=r"must be a \.py module or a saved \.json"):
        load_config(tmp_path / "c.yaml")


def test_a_derived_config_is_named_after_its_file(tmp_path: Path) -> None:
    """`derive` loads the base beside the file and names the result after the file (name and
    run folder); what the file then sets is kept, and the base is unchanged."""
    (tmp_path / "base.py").write_text(
        "from uvic.config import Config\n\n\ndef get_config():\n"
        "    return Config(name='base')\n")
    (tmp_path / "child.py").write_text(
        "from uvic.config import Config\nfrom uvic.presets import derive\n\n\n"
        "def get_config() -> Config:\n"
        "    cfg = derive('base', __file__)\n    cfg.optim.lr = 1\n    return cfg\n")
    child = load_config(tmp_path / "child.py")
    assert (child.name, child.train.output_dir) == ("child", "runs/child")
    assert child.optim.lr == 1.0 and type(child.optim.lr) is float  # loaded as declared
    assert load_config(tmp_path / "base.py") == Config(name="base")
    assert derive("base", tmp_path / "other.py").name == "other"
    # no such file beside it: the preset of that name, else one line naming both
    shipped = load_config(CONFIGS / "cifar10_uvic.py")
    assert derive("cifar10_uvic", tmp_path / "mine.py") == dataclasses.replace(
        shipped, name="mine", train=dataclasses.replace(shipped.train, output_dir="runs/mine"))
    with pytest.raises(ConfigError, match=r"mine\.py: derive\('cifar10_uvx'\): no "
                                          r"cifar10_uvx\.py beside it; no preset config"):
        derive("cifar10_uvx", tmp_path / "mine.py")
    # a file named as its base starts from the preset; a preset naming itself is refused
    (tmp_path / "cifar10_uvic.py").write_text(
        "from uvic.presets import derive\n\n\ndef get_config():\n"
        "    cfg = derive('cifar10_uvic', __file__)\n    cfg.optim.lr = 1e-5\n    return cfg\n")
    mine = load_config(tmp_path / "cifar10_uvic.py")
    assert (mine.optim.lr, mine.model.attention) == (1e-5, "uvic")
    with pytest.raises(ConfigError, match=r"derive\('cifar10_uvic'\) names this file itself"):
        derive("cifar10_uvic", CONFIGS / "cifar10_uvic.py")


def _override_strings(path: Path) -> list[str]:
    """The string constants of a Python file, docstrings aside, that read `key=value`."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings and re.match(r"[a-z_]+(\.[a-z0-9_]+)?=", node.value)]


def test_config_files_set_fields_in_python() -> None:
    """One dialect: a config file builds or changes fields in Python; `section.field=value`
    strings are the command line's."""
    assert _override_strings(Path(__file__))  # the check finds such strings
    found = {path.name: _override_strings(path) for path in sorted(CONFIGS.glob("*.py"))}
    assert {name: strings for name, strings in found.items() if strings} == {}


def test_the_documented_derived_config_loads(tmp_path: Path) -> None:
    """docs/configs.md's example of a config of one's own runs as written."""
    text = (CONFIGS.parent / "docs" / "configs.md").read_text()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "derive(" in b]
    (tmp_path / "mine.py").write_text(example)
    cfg = load_config(tmp_path / "mine.py")
    assert (cfg.name, cfg.optim.lr, cfg.train.batch_size) == ("mine", 1e-4, 64)
    assert cfg.model.attention == "uvic"
