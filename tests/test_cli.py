"""The programs as commands: every console script of pyproject.toml answers `--help`
without importing the heavy libraries, the files in scripts/ and eval/ run a command's
`main`, `import uvic` is light and exports the public API, and `--config` finds the
preset configs by name."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import runpy
import subprocess
import sys
import tomllib
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# What a program may import only once its work starts, not to print its usage.
HEAVY = ("torch", "triton", "torchvision", "diffusers", "accelerate", "open_clip",
         "matplotlib", "cleanfid", "scipy")

# Runs in a fresh interpreter: import the command's module, call its entry point as the
# console script does (with --help), report the exit status and the heavy modules loaded.
PROBE = """
import contextlib, importlib, io, json, sys
module, func = sys.argv[1].split(":")
args = json.loads(sys.argv[2])
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = getattr(importlib.import_module(module), func)(args)
    except SystemExit as exit:
        code = exit.code
print(json.dumps({"code": code, "usage": out.getvalue(), "stderr": err.getvalue(),
                  "heavy": sorted(m for m in sys.argv[3:] if m in sys.modules)}))
"""


def probe(entry: str, cwd: Path | None = None, args: tuple[str, ...] = ("--help",)) -> dict:
    """`entry` run with `args` (--help) in a fresh interpreter (see PROBE)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, entry, json.dumps(args), *HEAVY],
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_every_program_is_a_command() -> None:
    """The programs of the README are installed as commands (pyproject's [project.scripts])."""
    assert set(SCRIPTS) >= {
        "uvic-train", "uvic-sample", "uvic-fid", "uvic-fid-table", "uvic-quickstart",
        "uvic-analyze-attention", "uvic-table3", "uvic-release-table", "uvic-recipes-table",
        "uvic-extract-mscoco", "uvic-bench-train", "uvic-bench-sampling", "uvic-bench-kernels"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_loads_no_heavy_library(name: str, tmp_path: Path) -> None:
    """`<command> --help` exits 0 with its usage and imports none of HEAVY (they take
    seconds to import: a program imports them once its arguments parse)."""
    result = probe(SCRIPTS[name], cwd=tmp_path)
    assert result["code"] == 0
    assert result["usage"].startswith("usage:")
    assert result["heavy"] == [], f"{name} --help imports {', '.join(result['heavy'])}"


# A wrong config or option, as a user mistypes it, and the start of the line it must give.
START_UP_ERRORS = [
    ("uvic-train", ("--config", "missing.py"), "error: config file not found: missing.py"),
    ("uvic-train", ("--config", "cifar10_uvic", "--set", "model.nope=1"),
     "error: unknown config key 'model.nope'"),
    ("uvic-train", ("--config", "cifar10_uvic", "--set", "model.depth=abc"),
     "error: config key 'model.depth' expects int"),
    ("uvic-train", ("--config", "cifar10_uvic", "--set", "train.batch_size=0"),
     "error: train.batch_size=0 must be >= 1"),
    ("uvic-train", ("--config", "quickstart", "--set", "train.keep_steps=[]"),
     "error: sample.autoguidance_ckpt='checkpoints/step_001000/ema.safetensors' is neither"),
    ("uvic-quickstart", ("--set", "train.keep_steps=[]"),
     "error: sample.autoguidance_ckpt='checkpoints/step_001000/ema.safetensors' is neither"),
    ("uvic-sample", ("--config", "missing.py", "--ckpt", "x", "--out", "o"),
     "error: config file not found"),
    ("uvic-fid", ("--config", "cifar10_uvic", "--ckpt", "x", "--set", "eval.nope=1"),
     "error: unknown config key 'eval.nope'"),
    ("uvic-export", ("x", "--set", "model.nope=1", "--out", "o"),
     "error: unknown config key 'model.nope'"),
    ("uvic-analyze-attention", ("--config", "missing.py", "--checkpoint", "a=b", "--out", "o"),
     "error: config file not found"),
    ("uvic-quickstart", ("--set", "train.nope=1"), "error: unknown config key 'train.nope'"),
    ("uvic-quickstart", ("--threads", "0"), "error: --threads 0"),
    ("uvic-table3", ("--set", "train.nope=1"), "error: unknown config key 'train.nope'"),
    ("uvic-release-table", ("--only", "nope"), "error: --only ['nope']: matches no row"),
    ("uvic-recipes-table", ("--set", "sample.guidance_interval=2,1"),
     "error: sample.guidance_interval"),
    ("uvic-extract-mscoco", ("--coco", "missing", "--out", "o"),
     "error: --coco missing: no such folder"),
    ("uvic-posthoc-ema", ("run", "--sigma-rel", "0.5", "--out", "o"),
     "error: --sigma-rel 0.5: sigma_rel 0.5 is not in"),
    # checks that need no model: inputs that are not there, counts out of range, names
    # known from light lists (a diffusers scheduler's name without importing diffusers)
    ("uvic-sample", ("--config", "cifar10_uvic", "--ckpt", "/nope.safetensors", "--out", "o"),
     "error: --ckpt /nope.safetensors: no such file"),
    ("uvic-sample", ("--config", "cifar10_uvic", "--ckpt", "/nope.safetensors", "--out", "o",
                     "--n", "-3"), "error: --n -3: must be >= 1"),
    ("uvic-sample", ("--config", "cifar10_uvic", "--ckpt", "a", "--ckpt", "b", "--label", "A",
                     "--out", "o"), "error: got 1 --label for 2 --ckpt; give one each"),
    ("uvic-fid", ("--config", "cifar10_uvic", "--ckpt", "/nope.safetensors"),
     "error: --ckpt /nope.safetensors: no such file"),
    ("uvic-fid", ("--config", "cifar10_uvic", "--ckpt", "c", "--n", "1"),
     "error: --n 1: must be >= 2"),
    ("uvic-export", ("/nope", "--out", "o"), "error: export source not found: /nope"),
    ("uvic-posthoc-ema", ("/nope", "--sigma-rel", "0.1", "--out", "o"),
     "error: run folder not found: /nope"),
    ("uvic-compare", ("--seeds", "1", "--dry-run"), "error: --seeds 1: one seed gives no "
     "interval"),
    ("uvic-compare", ("--set", "model.attention=foo", "--dry-run"),
     "error: model.attention='foo': expected a preset"),
    ("uvic-train", ("--config", "quickstart", "--set", "model.attention=foo"),
     "error: model.attention='foo': expected a preset"),
    ("uvic-train", ("--config", "quickstart", "--set", "sample.scheduler=DDPMSchedular"),
     "error: sample.scheduler='DDPMSchedular' is neither"),
    ("uvic-train", ("--config", "cifar10_uvic", "--set", "diffusion.beta_max=0.01"),
     "error: diffusion.beta_min=0.1, diffusion.beta_max=0.01: the noise schedule must not end "
     "below its start"),
    ("uvic-quickstart", ("--preset", "cpu", "--set", "sample.steps=0"),
     "error: sample.steps=0 must be >= 1"),
]


@pytest.mark.parametrize("name, args, line", START_UP_ERRORS,
                         ids=[f"{n} {' '.join(a)}" for n, a, _ in START_UP_ERRORS])
def test_start_up_errors_load_no_heavy_library(name: str, args: tuple[str, ...], line: str,
                                               tmp_path: Path) -> None:
    """A wrong config file, `--set` key or value, or option ends with its one-line error
    before torch is imported (which takes seconds): every command checks first."""
    result = probe(SCRIPTS[name], cwd=tmp_path, args=args)
    assert result["code"] == 2, result
    assert result["stderr"].startswith(line) and result["stderr"].count("\n") == 1, result
    assert result["heavy"] == [], f"{name} {' '.join(args)} imports {result['heavy']}"


BROKEN_CONFIGS = [  # a config file's text, and the line its error must give
    ("from uvic.config import Config\n\ndef get_config(:\n    return Config()\n",
     "error: bad.py:3: SyntaxError: "),
    ("from uvic.config import Config\n\n\ndef get_config():\n    return Confg()\n",
     "error: bad.py:5: NameError: name 'Confg' is not defined"),
    ('{\n  "name": "x",\n  "train": {,}\n}\n', "error: bad.json:3: not valid JSON"),
    ("from uvic.config import Config\n\n\ndef get_config():\n    cfg = Config()\n"
     "    cfg.model.atention = 'uvic'\n    return cfg\n",
     "error: bad.py:6: AttributeError: 'ModelConfig' object has no attribute 'atention'"),
    ("from uvic.config import Config\n\n\ndef get_config():\n    cfg = Config()\n"
     "    cfg.optim.lr = '1e-4'\n    return cfg\n",
     "error: bad.py: optim.lr must be float, got str '1e-4'"),
]


@pytest.mark.parametrize("text, line", BROKEN_CONFIGS,
                         ids=["syntax", "name", "json", "misspelt field", "wrong type"])
def test_a_broken_config_file_is_one_line_at_its_line(text: str, line: str,
                                                      tmp_path: Path) -> None:
    """A config file that does not load says `file:line: what` in one line (no traceback),
    before torch is imported."""
    name = "bad.json" if text.startswith("{") else "bad.py"
    (tmp_path / name).write_text(text)
    result = probe(SCRIPTS["uvic-train"], cwd=tmp_path, args=("--config", name))
    assert result["code"] == 2, result
    assert result["stderr"].startswith(line) and result["stderr"].count("\n") == 1, result
    assert result["heavy"] == []


class Parsed(Exception):
    """Raised in place of a command's work once it has built its parser."""


def command_parsers(name: str) -> list[argparse.ArgumentParser]:
    """The parser of command `name` (its entry point run with --help, stopped at its
    parse) and every subcommand's parser below it."""
    found: list[argparse.ArgumentParser] = []

    def stop(self: argparse.ArgumentParser, *args, **kwargs):
        found.append(self)
        raise Parsed

    module, func = SCRIPTS[name].split(":")
    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop), \
            contextlib.suppress(Parsed):
        getattr(importlib.import_module(module), func)(["--help"])
    assert found, f"{name} built no parser"
    parsers, todo = [], found[:1]
    while todo:
        parser = todo.pop(0)
        parsers.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return parsers


# Options that still lack a help text, by command (uvic/cli/gated_attention.py's own
# options): listed exactly, so that each one given its help leaves this list.
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_option_has_help(name: str) -> None:
    """Every option of every command (and of its subcommands) says what it does in --help."""
    missing = set()
    for parser in command_parsers(name):
        sub = parser.prog.split(" ", 1)[1] + " " if " " in parser.prog else ""
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if action.help is argparse.SUPPRESS:
                continue
            if not (action.help or "").strip():
                missing.add(sub + (action.option_strings or [action.dest])[0])
    assert not missing, f"{name}: options without help: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_description_is_whole_sentences(name: str) -> None:
    """A command's --help description ends where a sentence ends, not where its
    docstring's first line happens to break."""
    for parser in command_parsers(name):
        text = " ".join((parser.description or "").split())
        assert not text or text[-1] in ".)!?", f"{parser.prog}: ...{text[-60:]!r}"


def test_import_uvic_is_light() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import json, sys, uvic, uvic_kernels, uvic.cli, uvic.presets; "
         f"print(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


@pytest.mark.parametrize("path", sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("eval/*.py")]),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_run_a_commands_main(path: Path) -> None:
    """Every file in scripts/ and eval/ is a thin entry: its `main` is a command's."""
    entries = {}
    for name, entry in SCRIPTS.items():
        module, func = entry.split(":")
        entries[name] = getattr(importlib.import_module(module), func)
    main = runpy.run_path(str(path), run_name="entry_check")["main"]
    assert any(main is f for f in entries.values()), f"{path} runs no command's main"


def test_docs_name_every_command() -> None:
    """docs/configs.md's table of the installed commands names every one."""
    table = (ROOT / "docs" / "configs.md").read_text()
    missing = [name for name in SCRIPTS if f"| `{name}` |" not in table]
    assert not missing, f"docs/configs.md does not name {missing}"


# --------------------------------------------------------------------------- public API


def test_public_api_names_resolve() -> None:
    """Each name of `uvic.__all__` is the object its module defines, and is documented."""
    import uvic

    assert set(uvic.__all__) >= {"load_config", "build_model", "train", "sample_to_folder",
                                 "generate", "evaluate"}
    for name in uvic.__all__:
        module = importlib.import_module(uvic._API[name])
        assert getattr(uvic, name) is getattr(module, name), name
        assert f"`{name}" in uvic.__doc__, f"uvic's docstring does not say what {name} is for"
        assert name in dir(uvic)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        uvic.nonexistent  # noqa: B018


def test_kernels_api_resolves() -> None:
    import uvic_kernels
    from uvic_kernels import fused_attention, reference

    for name in uvic_kernels.__all__:
        source = fused_attention if hasattr(fused_attention, name) else reference
        assert getattr(uvic_kernels, name) is getattr(source, name), name


# --------------------------------------------------------------------------- presets


def test_config_by_preset_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from uvic.presets import preset_names, preset_path, resolve_config

    assert {"cifar10_uvit", "cifar10_uvic", "mscoco_uvit", "mscoco_uvic",
            "quickstart"} <= set(preset_names())
    preset = ROOT / "configs" / "cifar10_uvic.py"
    assert preset_path("cifar10_uvic") == preset == preset_path("cifar10_uvic.py")
    monkeypatch.chdir(tmp_path)  # no configs/ here: the shipped presets
    assert resolve_config("cifar10_uvic") == preset
    assert resolve_config("configs/cifar10_uvic.py") == preset
    (tmp_path / "configs").mkdir()  # a local file of that name wins
    (tmp_path / "configs" / "cifar10_uvic.py").write_text("")
    assert resolve_config("configs/cifar10_uvic.py") == Path("configs/cifar10_uvic.py")
    for other in ("runs/x/config.json", "elsewhere/cifar10_uvic.py", "nothere.py"):
        assert resolve_config(other) == Path(other)  # the loader says it is missing
    with pytest.raises(FileNotFoundError, match=r"no preset config 'cifar10' \(presets: "):
        resolve_config("cifar10")


# The commands that take --config (uvic.cli.config_options), with the other arguments
# they require.
CONFIG_COMMANDS = {
    "uvic-train": [],
    "uvic-sample": ["--ckpt", "c.safetensors", "--out", "o"],
    "uvic-fid": ["--ckpt", "c.safetensors"],
    "uvic-export": ["run", "--out", "o"],
    "uvic-analyze-attention": ["c.safetensors", "--out", "o"],
    "uvic-compare": [],
}


def test_config_commands_are_listed(capsys) -> None:
    """CONFIG_COMMANDS is every command whose usage has --config."""
    with_config = set()
    for name, entry in SCRIPTS.items():
        module, func = entry.split(":")
        with pytest.raises(SystemExit):
            getattr(importlib.import_module(module), func)(["--help"])
        if "--config CONFIG" in capsys.readouterr().out:
            with_config.add(name)
    assert with_config == set(CONFIG_COMMANDS)


@pytest.mark.parametrize("name", sorted(CONFIG_COMMANDS))
def test_config_takes_a_preset_name(name: str, tmp_path: Path, capsys,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command's --config takes a preset's name (the program sees its file) as well
    as a path; an unknown name ends the program with one line listing the presets, exit
    status 2. --set gathers into args.set."""
    parse_args = importlib.import_module(SCRIPTS[name].split(":")[0]).parse_args
    rest = CONFIG_COMMANDS[name]
    monkeypatch.chdir(tmp_path)  # no configs/ here: the shipped presets
    args = parse_args(["--config", "cifar10_uvic", "--set", "train.seed=1", *rest])
    assert Path(args.config) == ROOT / "configs" / "cifar10_uvic.py"
    assert args.set == ["train.seed=1"]
    assert parse_args(["--config", "runs/x/config.json", *rest]).config == "runs/x/config.json"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        parse_args(["--config", "cifar100_uvit", *rest])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no preset config 'cifar100_uvit' (presets: ")
    assert "cifar10_uvic, cifar10_uvic_flow, cifar10_uvid, cifar10_uvid2, cifar10_uvis" in err
    assert err.count("\n") == 1


def test_extraction_defaults_are_the_configs_models() -> None:
    """uvic-extract-mscoco's --vae / --clip-* defaults (read from DataConfig, light) are the
    models the extraction library and the MS-COCO configs use."""
    from uvic.cli.extract_mscoco import parse_args
    from uvic.models.autoencoder import DEFAULT_VAE
    from uvic.models.text_encoder import DEFAULT_MODEL, DEFAULT_PRETRAINED

    args = parse_args(["--coco", "c", "--out", "o"])
    assert (args.vae, args.clip_model, args.clip_pretrained) == (
        DEFAULT_VAE, DEFAULT_MODEL, DEFAULT_PRETRAINED)


def declared_options(name: str, argv: list[str],
                     monkeypatch: pytest.MonkeyPatch) -> dict[str, argparse.Action]:
    """The options of command `name` (its module's parse_args on `argv`) by flag."""
    parsers = []
    parse = argparse.ArgumentParser.parse_args

    def record(self: argparse.ArgumentParser, *args, **kwargs):
        parsers.append(self)
        return parse(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", record)
        importlib.import_module(SCRIPTS[name].split(":")[0]).parse_args(argv)
    return {flag: action for action in parsers[0]._actions for flag in action.option_strings}


# Commands that share options (uvic.cli.sampler_options, uvic.cli.extract_options): the
# options both declare alike, with each command's required arguments.
SHARED_OPTIONS = [
    (("uvic-sample", ["--config", "cifar10_uvic", "--ckpt", "c", "--out", "o"]),
     ("uvic-fid", ["--config", "cifar10_uvic", "--ckpt", "c"]),
     ["--steps", "--scheduler", "--order", "--cfg-scale", "--batch-size", "--seed",
      "--precision"]),
    (("uvic-extract-imagenet", ["--imagenet", "i", "--out", "o"]),
     ("uvic-extract-mscoco", ["--coco", "c", "--out", "o"]),
     ["--out", "--workers", "--device", "--skip-corrupt", "--no-progress"]),
]


@pytest.mark.parametrize("first, second, flags", SHARED_OPTIONS)
def test_shared_options_are_declared_alike(first: tuple, second: tuple, flags: list[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler options of uvic-sample and uvic-fid, and the run options of the two
    extraction commands, have the same type, default, choices and help in both."""
    ours, theirs = (declared_options(name, argv, monkeypatch) for name, argv in (first, second))
    for flag in flags:
        a, b = ours[flag], theirs[flag]
        assert (a.type, a.default, a.choices, a.help) == (b.type, b.default, b.choices,
                                                          b.help), flag


@pytest.mark.parametrize("flag", ["--batch-size", "--text-batch-size", "--chunk-size"])
def test_extract_mscoco_refuses_a_size_below_one(flag, capsys) -> None:
    """A batch or chunk size below 1 is a usage error (exit 2) naming the flag, as in
    uvic-extract-imagenet."""
    from uvic.cli import extract_mscoco

    with pytest.raises(SystemExit) as exc:
        extract_mscoco.parse_args(["--coco", "c", "--out", "o", flag, "0"])
    assert exc.value.code == 2
    assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


# --------------------------------------------------------------------------- the error path
class _Stopped(KeyboardInterrupt):
    signum = 15  # SIGTERM, as a run stopped by a signal raises it


class _Failed(RuntimeError):
    exit_status = 1


def test_one_error_path_for_every_program(capsys, monkeypatch) -> None:
    """`run_reported`: an expected error is its first line on stderr and status 2 (or the
    error's own), a stop by signal 128 + its number after the note, any other error raises;
    "module:Class" kinds count only where the module is loaded (it is never imported)."""
    from uvic.cli.errors import run_reported

    def fail(err: BaseException):
        def body() -> int:
            raise err
        return body

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert run_reported(lambda: None) == 0 and run_reported(lambda: 3) == 3
    assert run_reported(fail(ValueError("train.lr=-1: must be > 0\nmore"))) == 2
    assert capsys.readouterr().err == "error: train.lr=-1: must be > 0\n"
    assert run_reported(fail(_Failed("U-ViT: loss is nan")), (_Failed,)) == 1
    assert run_reported(fail(_Stopped()), resume_note="run it again") == 128 + 15
    assert capsys.readouterr().err.splitlines()[-1] == "stopped by SIGTERM: run it again"
    with pytest.raises(TypeError):
        run_reported(fail(TypeError("a bug: its traceback")))
    with pytest.raises(RuntimeError):  # its module is not loaded: not one of its errors
        run_reported(fail(RuntimeError("x")), ("uvic_nonexistent.module:Error",))
    assert "uvic_nonexistent" not in sys.modules
    monkeypatch.setitem(sys.modules, "uvic_loaded", mock.Mock(Error=_Failed))
    assert run_reported(fail(_Failed("y")), ("uvic_loaded:Error",)) == 1


def test_seed_precision_and_count_flags_are_config_overrides() -> None:
    """`--seed`, `--precision` (uvic-sample, uvic-fid) and uvic-fid's `--n` set
    sample.seed, sample.precision and eval.n_samples, so the saved config records them;
    unset, the config's values hold; a precision no sampler knows is refused naming it."""
    from uvic.cli import fid, sample
    from uvic.cli.sampler_options import sampler_overrides
    from uvic.config import ConfigError, load_config
    from uvic.config.validation import validate
    from uvic.presets import preset_path

    given = sample.parse_args(["--config", "cifar10_uvic", "--ckpt", "c", "--out", "o",
                               "--seed", "3", "--precision", "bf16"])
    assert sampler_overrides(given)[-2:] == ["sample.seed=3", "sample.precision=bf16"]
    assert sampler_overrides(sample.parse_args(["--config", "cifar10_uvic", "--ckpt", "c",
                                                "--out", "o"])) == []
    assert "eval.n_samples=7" in fid.overrides(fid.parse_args(
        ["--config", "cifar10_uvic", "--ckpt", "c", "--n", "7"]))
    cfg = load_config(preset_path("cifar10_uvic"), sampler_overrides(given))
    assert (cfg.sample.seed, cfg.sample.precision) == (3, "bf16")
    with pytest.raises(ConfigError, match=r"sample\.precision='fp8'"):
        validate(load_config(preset_path("cifar10_uvic"), ["sample.precision=fp8"]))
