"""`train.compile` (uvic.training.compile): the modes and their old bool form, no graph
break in the model, compiled training = eager training (grad accumulation, EMA), and exact
resume across compile on/off. Compiled runs use CPU inductor (C++): two of them, ~40 s each
on a busy 2-core machine, shared by the tests through one module fixture."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import TorchDynamoPlugin
from safetensors.torch import load_file
from test_model import inputs, tiny
from test_train import shapes_config

from uvic.config import ConfigError, apply_overrides, from_dict, load_config, to_dict
from uvic.config.training import TRAIN_COMPILE_MODES, compile_mode
from uvic.config.validation import validate
from uvic.run.folder import RunFolder
from uvic.run.weights import unwrap_model
from uvic.training.compile import compile_note, dynamo_kwargs
from uvic.training.launch import TrainError, make_accelerator
from uvic.training.trainer import train

REPO = Path(__file__).resolve().parents[1]
STEPS, SPLIT = 4, 2  # runs of 4 steps; checkpoint (and resume) at step 2
RUN = ("train.grad_accum=2", f"train.max_steps={STEPS}", f"train.ckpt_every={SPLIT}",
       "train.keep_last=5", "train.ema_decay=0.5")  # an EMA that moves visibly in 4 steps


def fresh_state() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    fresh_state()


# --------------------------------------------------------------------------- the setting


def test_compile_modes_and_the_old_bool(tmp_path: Path) -> None:
    """true = default, false = off (configs and run folders from before the modes); every
    mode by name; anything else one line naming the key and the allowed values."""
    assert [compile_mode(m) for m in TRAIN_COMPILE_MODES] == list(TRAIN_COMPILE_MODES)
    assert compile_mode(True) == "default" and compile_mode(False) == "off"
    base = load_config(REPO / "configs" / "cifar10_uvit.py")
    assert base.train.compile == "off"
    for raw, mode in [("true", "default"), ("0", "off"), ("off", "off"),
                      ("reduce-overhead", "reduce-overhead"), ("max-autotune", "max-autotune")]:
        cfg = validate(apply_overrides(base, [f"train.compile={raw}"]))
        assert compile_mode(cfg.train.compile) == mode
    old = to_dict(base)
    old["train"]["compile"] = True  # a run's config.json written by an older uvic
    path = tmp_path / "config.json"
    path.write_text(json.dumps(old))
    assert compile_mode(validate(load_config(path)).train.compile) == "default"
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(base, ["train.compile=fast"]))
    assert str(err.value) == ("train.compile='fast' must be one of off, default, "
                              "reduce-overhead, max-autotune, max-autotune-no-cudagraphs "
                              "(or true = default, false = off)")
    with pytest.raises(ConfigError, match=r"train.compile must be bool \| str, got int 3"):
        from_dict({"train": {"compile": 3}})


def test_compile_mode_becomes_accelerates_plugin() -> None:
    assert dynamo_kwargs(False) == {"dynamo_backend": "no"} == dynamo_kwargs("off")
    plugin = dynamo_kwargs("reduce-overhead")["dynamo_plugin"]
    assert plugin.to_kwargs() == {"backend": "inductor", "mode": "reduce-overhead",
                                  "fullgraph": True}
    assert dynamo_kwargs(True)["dynamo_plugin"].mode == "default"
    assert compile_note("reduce-overhead", "cuda") is None
    assert compile_note("default", "cpu") is None
    assert compile_note("max-autotune", "cpu") == (
        "note: train.compile=max-autotune: CUDA graphs need a CUDA device; on cpu torch "
        "compiles the model without them")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["uncond", "class", "text"])
def test_model_forward_has_no_graph_break(kind: str) -> None:
    """Dynamo captures the training forward in one graph, with and without gradient
    checkpointing (the compiled runs below use fullgraph=True for the backward too)."""
    for checkpointing in (False, True):
        model = tiny(kind, attention="uvic", grad_checkpointing=checkpointing).train()
        x, t, context, y = inputs(kind)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(x, t, context=context, y=y)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
            explained.break_reasons


def test_accelerate_checkpoints_plain_names_of_a_compiled_model(tmp_path: Path) -> None:
    """What exact resume across compile on/off rests on: Accelerate's save_state of a
    compiled model writes the plain names (not `_orig_mod.`), and load_state puts them into
    a compiled model or a plain one. (Dynamo's eager backend: fast.)"""

    def prepared(compiled: bool, seed: int) -> tuple[Accelerator, torch.nn.Module]:
        fresh_state()
        acc = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(
            backend="eager" if compiled else "no"))
        torch.manual_seed(seed)
        model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh()))
        assert compiled == ("_orig_mod.0.weight" in model.state_dict())
        return acc, model

    acc, model = prepared(True, 0)
    saved = unwrap_model(model).state_dict()
    acc.save_state(str(tmp_path))
    assert load_file(tmp_path / "model.safetensors").keys() == {"0.weight", "0.bias"}
    for compiled in (False, True):
        acc, model = prepared(compiled, 1)
        acc.load_state(str(tmp_path))
        loaded = unwrap_model(model).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_accelerator_notes_and_refuses(tmp_path: Path, capsys) -> None:
    """No CUDA graphs on a CPU: said once at start. A process whose Accelerate state was set
    up for another compile setting (Accelerate keeps the first) is refused in one line."""
    graphs = shapes_config(tmp_path, "train.compile=reduce-overhead")
    make_accelerator(graphs.train, RunFolder(tmp_path))
    out = capsys.readouterr().out
    assert out.count("note: train.compile=reduce-overhead: CUDA graphs need a CUDA") == 1
    with pytest.raises(TrainError, match=r"^train.compile=off but this process's Accelerate "
                       r"state, set up by an earlier Accelerator, compiles reduce-overhead"):
        make_accelerator(shapes_config(tmp_path, "train.compile=false").train, RunFolder(tmp_path))


# --------------------------------------------------------------------------- compiled runs


def run(out: Path, compile: str, resume: str | None = None) -> Path:
    fresh_state()
    torch._dynamo.utils.counters.clear()
    train(shapes_config(out, f"train.compile={compile}", *RUN), resume=resume)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert (graphs > 0) == (compile != "off"), f"{compile}: {graphs} graphs compiled"
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Eager and compiled runs of the same 4 steps (2 micro-batches each, EMA), and the
    two halves crossed: the first 2 steps of one, resumed at step 2 by the other."""
    root = tmp_path_factory.mktemp("compile")
    out = {"eager": run(root / "eager", "off"), "compiled": run(root / "compiled", "default")}
    for first, then, mode in (("compiled", "eager", "off"), ("eager", "compiled",
                                                             "reduce-overhead")):
        folder = root / f"{first}_then_{then}"
        shutil.copytree(out[first], folder)
        shutil.rmtree(folder / "checkpoints" / f"step_{STEPS:06d}")
        out[f"{first}_then_{then}"] = run(folder, mode, resume="latest")
        fresh_state()
    return out


def weights(run: Path, step: int = STEPS) -> dict[str, dict[str, torch.Tensor]]:
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    return {name: load_file(ckpt / f"{name}.safetensors") for name in ("model", "ema")}


def assert_close(a: Path, b: Path, step: int = STEPS) -> None:
    wa, wb = weights(a, step), weights(b, step)
    for name in wa:
        assert wa[name].keys() == wb[name].keys(), name
        for key in wa[name]:
            torch.testing.assert_close(wa[name][key], wb[name][key], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, where=f"{name} {key}": f"{where}: {m}")
    losses = [[r["loss"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())]
              for run in (a, b)]
    assert len(losses[0]) == len(losses[1]) == STEPS // 2
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


@pytest.mark.slow
def test_compiled_training_matches_eager(runs: dict[str, Path]) -> None:
    """Same losses, weights and EMA as eager, within float rounding; the checkpoints keep
    the plain names; the run says and records that it compiled."""
    assert_close(runs["compiled"], runs["eager"], SPLIT)
    assert_close(runs["compiled"], runs["eager"])
    assert not [k for k in weights(runs["compiled"])["model"] if "_orig_mod" in k]
    summary = json.loads((runs["compiled"] / "summary.json").read_text())
    assert summary["launch"]["compile"] == "default"
    assert json.loads((runs["eager"] / "summary.json").read_text())["launch"]["compile"] == "off"


@pytest.mark.slow
def test_resume_across_compile_on_and_off(runs: dict[str, Path]) -> None:
    """Compiled to step 2, eager from there (and the reverse, in reduce-overhead mode, which
    on a CPU compiles without CUDA graphs): the uninterrupted run's weights and losses."""
    assert_close(runs["compiled_then_eager"], runs["eager"])
    assert_close(runs["eager_then_compiled"], runs["eager"])
    config = json.loads((runs["eager_then_compiled"] / "config.json").read_text())
    assert config["train"]["compile"] == "reduce-overhead"
    # --set train.compile=off reads as false (off)
    assert config["resumes"][0]["changes"]["train.compile"] == [False, "reduce-overhead"]
