"""`UViT` and `UViTPipeline` against what diffusers expects of its own models and pipelines.

diffusers' common model tests hold every model to a contract; these tests state that
contract for uvic's U-ViT in their own terms: the forward's two return forms agree;
save/load round trips (safetensors or pickle, a weights variant, shards) rebuild the
same function; a dtype asked for at load is the parameters' dtype; the model is
deterministic, trains (an optimizer step, diffusers' `EMAModel`), recomputes under
diffusers' gradient checkpointing to the same gradients and runs under bf16 autocast;
the constructor's arguments are the config's fields; the attention is the config's
(`set_attention`, saved), with no processor interface for diffusers' tests to hold it to.
For the pipeline, what diffusers' pipeline tests check: save/load, an optional component
left out, dtype, images per prompt, given latents, `callback_on_step_end`, a batch equal
to its images made one by one, and diffusers' generic `DiffusionPipeline.from_pretrained`
of a saved folder in a new process. Tiny random models on the CPU (attention in PyTorch).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import DDIMScheduler
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.training_utils import EMAModel

from uvic.config import DiffusionConfig, ModelConfig
from uvic.diffusion.schedule import Diffusion, diffusion_loss
from uvic.models.attention_processor import CogAttnProcessor
from uvic.models.uvit import UViT
from uvic.pipelines import UViTPipeline
from uvic.sampling.noise import sample_generators
from uvic_kernels.modes import MODES as KERNEL_MODES

TINY = {"img_size": 8, "patch_size": 2, "embed_dim": 16, "depth": 2, "num_heads": 2,
        "num_classes": 4, "attention": "uvic", "attention_backend": "torch"}


def tiny(seed: int = 0, **changes: object) -> UViT:
    torch.manual_seed(seed)
    return UViT(**{**TINY, **changes})


def inputs(batch: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(batch, 3, 8, 8, generator=g),
            "t": torch.rand(batch, generator=g) * 999,
            "y": torch.randint(0, 4, (batch,), generator=g)}


def public(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def predict(model: UViT, **kw: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(**(kw or inputs()), return_dict=False)[0]


# --------------------------------------------------------------------------- forward


def test_both_return_forms_give_the_same_sample() -> None:
    model = tiny().eval()
    with torch.no_grad():
        out = model(**inputs())
        plain = model(**inputs(), return_dict=False)
    assert isinstance(out, Transformer2DModelOutput)
    assert isinstance(plain, tuple) and len(plain) == 1
    assert torch.equal(out.sample, plain[0]) and torch.equal(out[0], plain[0])
    assert out.sample.shape == (2, 3, 8, 8)


def test_forward_is_deterministic() -> None:
    model = tiny().eval()
    assert torch.equal(predict(model), predict(model))
    assert torch.equal(predict(tiny()), predict(model))  # same seed, same init


# --------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("safe", [True, False])
@pytest.mark.parametrize("variant", [None, "ema"])
def test_save_load_round_trip(tmp_path: Path, safe: bool, variant: str | None) -> None:
    model = tiny(attention="softmax,expressive,cog").eval()
    model.save_pretrained(tmp_path, safe_serialization=safe, variant=variant)
    stem = "diffusion_pytorch_model" + (f".{variant}" if variant else "")
    assert (tmp_path / f"{stem}.{'safetensors' if safe else 'bin'}").is_file()
    if variant:  # a variant is not the default weights
        with pytest.raises((OSError, EnvironmentError)):
            UViT.from_pretrained(tmp_path)
    loaded = UViT.from_pretrained(tmp_path, variant=variant).eval()
    assert loaded.attention_modes == ["softmax", "expressive", "cog"]
    assert public(loaded.config) == public(model.config)
    assert torch.equal(predict(loaded), predict(model))


@pytest.mark.parametrize("variant", [None, "ema"])
def test_sharded_save_loads_as_one(tmp_path: Path, variant: str | None) -> None:
    model = tiny().eval()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(tmp_path, max_shard_size=size // 4, variant=variant)
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) >= 3
    index = json.loads(next(tmp_path.glob("*.index*.json")).read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    loaded = UViT.from_pretrained(tmp_path, variant=variant).eval()
    assert torch.equal(predict(loaded), predict(model))


def test_dtype_asked_for_at_load(tmp_path: Path) -> None:
    model = tiny().eval()
    model.save_pretrained(tmp_path / "fp32")
    bf16 = UViT.from_pretrained(tmp_path / "fp32", torch_dtype=torch.bfloat16).eval()
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    again = UViT.from_pretrained(tmp_path / "bf16", torch_dtype=torch.bfloat16).eval()
    assert {p.dtype for p in again.parameters()} == {torch.bfloat16}
    x = inputs()
    out = predict(again, **{**x, "x": x["x"].bfloat16()})
    assert out.dtype == torch.bfloat16 and torch.equal(out, predict(bf16, **{**x, "x":
                                                                           x["x"].bfloat16()}))


# --------------------------------------------------------------------------- training


def loss_of(model: UViT, seed: int = 3) -> torch.Tensor:
    batch = inputs(4, seed)
    diffusion = Diffusion(DiffusionConfig())
    return diffusion_loss(model, diffusion, {"x": batch["x"], "y": batch["y"]},
                          torch.Generator().manual_seed(seed))


def test_a_training_step_reaches_every_parameter() -> None:
    model = tiny().train()
    before = predict(model.eval())
    model.train()
    loss = loss_of(model)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters())
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    assert not torch.equal(predict(model.eval()), before)


def test_diffusers_ema_training_and_its_saved_model(tmp_path: Path) -> None:
    model = tiny().train()
    ema = EMAModel(model.parameters(), decay=0.9, model_cls=UViT, model_config=model.config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        loss_of(model, seed=step).backward()
        opt.step()
        ema.step(model.parameters())
    averaged = tiny()
    ema.copy_to(averaged.parameters())
    assert not torch.equal(predict(averaged.eval()), predict(model.eval()))
    ema.save_pretrained(tmp_path / "ema")
    loaded = EMAModel.from_pretrained(tmp_path / "ema", model_cls=UViT)
    restored = tiny()
    loaded.copy_to(restored.parameters())
    assert torch.equal(predict(restored.eval()), predict(averaged))


def test_diffusers_gradient_checkpointing_gives_the_same_gradients() -> None:
    plain = tiny().train()
    ckpt = copy.deepcopy(plain)
    ckpt.enable_gradient_checkpointing()
    assert ckpt.gradient_checkpointing and not plain.gradient_checkpointing
    loss_of(plain).backward()
    loss_of(ckpt).backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    ckpt.disable_gradient_checkpointing()
    assert not ckpt.gradient_checkpointing


def test_bf16_autocast_forward_and_backward() -> None:
    model = tiny().train()
    reference = predict(copy.deepcopy(model).eval())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**inputs(), return_dict=False)[0]
        loss = loss_of(model)
    assert out.dtype == torch.bfloat16
    loss.backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)


# --------------------------------------------------------------------------- attention


def test_constructor_arguments_are_the_config_fields() -> None:
    """`UViT`'s keyword arguments are `ModelConfig`'s fields with the same defaults, and
    diffusers records exactly them."""
    params = inspect.signature(UViT.__init__).parameters
    fields = dataclasses.fields(ModelConfig)
    assert [p for p in params if p != "self"] == [f.name for f in fields]
    assert {p.name: p.default for p in params.values() if p.name != "self"} == {
        f.name: f.default for f in fields}
    recorded = {k: v for k, v in tiny().config.items() if not k.startswith("_")}
    assert recorded == {**dataclasses.asdict(ModelConfig()), **TINY}


def test_attention_is_the_config_not_a_processor_interface() -> None:
    """No `attn_processors` / `set_attn_processor`: diffusers' common tests skip those on
    such a model, and a diffusers processor called on a U-ViT block says where to go."""
    model = tiny()
    assert not hasattr(model, "set_attn_processor") and not hasattr(model, "attn_processors")
    assert model.attention_modes == ["softmax", "cog", "softmax"]
    assert all(blk.attn.backend == "torch" for blk in model.blocks())
    with pytest.raises(ValueError, match=r"UViT\.set_attention") as err:
        CogAttnProcessor("torch")(model.mid_block.attn, inputs()["x"])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_set_attention_switches_every_block_and_is_saved(tmp_path: Path, mode: str) -> None:
    """A model switched to one mode runs as the model built with it, and the config keeps it."""
    model = tiny().eval()
    model.set_attention([mode] * 3)
    assert model.attention_modes == [mode] * 3 and model.config.attention == [mode] * 3
    built = tiny(attention=",".join([mode] * 3)).eval()
    assert torch.equal(predict(model), predict(built))
    model.save_pretrained(tmp_path)
    loaded = UViT.from_pretrained(tmp_path).eval()
    assert loaded.attention_modes == [mode] * 3
    assert torch.equal(predict(loaded), predict(model))


def test_set_attention_preset_and_backend_reach_the_config() -> None:
    model = tiny().eval()
    model.set_attention("uvit", backend="auto")
    assert model.config.attention == "uvit" and model.config.attention_backend == "auto"
    assert {blk.attn.backend for blk in model.blocks()} == {None}
    model.set_attention("uvic", backend="torch")
    assert torch.equal(predict(model), predict(tiny().eval()))


@pytest.mark.parametrize(("spec", "backend"), [
    ("nope", None), (["softmax", "cog"], None), ("uvic", "sdpa"), ("uvit", "cuda"),
], ids=["unknown preset", "wrong length", "sdpa runs softmax only", "unknown backend"])
def test_a_bad_pattern_is_one_error_and_changes_nothing(spec: object, backend: object) -> None:
    model = tiny()
    before, config = model.attention_modes, dict(model.config)
    with pytest.raises(ValueError) as err:
        model.set_attention(spec, backend=backend)
    assert "\n" not in str(err.value)
    assert model.attention_modes == before and dict(model.config) == config


# --------------------------------------------------------------------------- pipeline


def tiny_pipeline(seed: int = 0) -> UViTPipeline:
    """A class-conditional pixel-space pipeline (no VAE) with a null class for guidance."""
    diffusion = {"schedule": "vp_continuous", "beta_min": 0.1, "beta_max": 20.0}
    scheduler = DDIMScheduler(**Diffusion(DiffusionConfig(**diffusion)).scheduler_kwargs(),
                              clip_sample=False)
    pipe = UViTPipeline(transformer=tiny(seed).eval(), scheduler=scheduler, vae=None,
                        diffusion=diffusion, scale_factor=None, cfg_scale=0.5, null_class=3)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def images(pipe: UViTPipeline, labels: list[int], seed: int = 0, **kw: object) -> torch.Tensor:
    return pipe(class_labels=labels, num_inference_steps=3, output_type="pt",
                generator=sample_generators(seed, range(len(labels))), **kw).images


def test_pipeline_save_load_with_its_optional_component_left_out(tmp_path: Path) -> None:
    pipe = tiny_pipeline()
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["vae"] == [None, None] and index["scale_factor"] is None
    assert not (tmp_path / "vae").exists()
    loaded = UViTPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.vae is None and type(loaded.scheduler) is DDIMScheduler
    assert torch.equal(images(loaded, [0, 2]), images(pipe, [0, 2]))


def test_pipeline_dtype(tmp_path: Path) -> None:
    pipe = tiny_pipeline()
    pipe.save_pretrained(tmp_path)
    half = UViTPipeline.from_pretrained(tmp_path, dtype=torch.bfloat16)  # was torch_dtype
    half.set_progress_bar_config(disable=True)
    assert half.transformer.dtype == torch.bfloat16
    out = images(half, [0, 1])
    assert out.dtype == torch.float32 and out.shape == (2, 3, 8, 8)
    assert (out - images(pipe, [0, 1])).abs().mean() < 0.05


def test_num_images_per_prompt_repeats_each_label() -> None:
    pipe, seen = tiny_pipeline(), []
    forward = pipe.transformer.forward
    pipe.transformer.forward = lambda *a, **k: (seen.append(k["y"]), forward(*a, **k))[1]
    out = pipe(class_labels=[0, 2], num_images_per_prompt=3, num_inference_steps=2,
               output_type="pt").images
    assert out.shape == (6, 3, 8, 8)
    assert seen[0].tolist() == [0, 0, 0, 2, 2, 2, 3, 3, 3, 3, 3, 3]  # with the null class


def test_given_latents_fix_the_images() -> None:
    pipe = tiny_pipeline()
    latents = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    a = pipe(class_labels=[1, 2], latents=latents, num_inference_steps=3, output_type="pt")
    b = pipe(class_labels=[1, 2], latents=latents.clone(), num_inference_steps=3,
             output_type="pt")
    assert torch.equal(a.images, b.images)
    c = pipe(class_labels=[1, 2], latents=-latents, num_inference_steps=3, output_type="pt")
    assert not torch.equal(a.images, c.images)
    with pytest.raises(ValueError, match="latents must have shape"):
        pipe(class_labels=[1, 2], latents=latents[:1], num_inference_steps=3)


def test_callback_on_step_end_sees_and_replaces_the_latents() -> None:
    pipe, calls = tiny_pipeline(), []

    def callback(p: UViTPipeline, i: int, t: torch.Tensor, kw: dict) -> dict:
        assert p is pipe and set(kw) == {"latents"}
        calls.append((i, int(t)))
        return {"latents": torch.zeros_like(kw["latents"])} if i == 2 else kw

    out = images(pipe, [0, 1], callback_on_step_end=callback)
    assert [i for i, _ in calls] == [0, 1, 2]
    assert [t for _, t in calls] == [int(t) for t in pipe.scheduler.timesteps]
    assert torch.equal(out, torch.full_like(out, 0.5))  # x0 = 0 is grey
    watched = images(pipe, [0, 1], callback_on_step_end=lambda p, i, t, kw: kw)
    assert torch.equal(watched, images(pipe, [0, 1]))  # a callback that only looks
    with pytest.raises(ValueError, match="prompt_embeds"):
        images(pipe, [0], callback_on_step_end=callback,
               callback_on_step_end_tensor_inputs=["prompt_embeds"])
    with pytest.raises(ValueError, match="steps by itself"):
        images(pipe, [0], callback_on_step_end=callback,
               sampler="dpm_solver++_fast_time_uniform")


def test_a_batch_equals_its_images_one_by_one() -> None:
    pipe = tiny_pipeline()
    batch = images(pipe, [0, 1, 2], seed=4)
    for i, label in enumerate([0, 1, 2]):
        alone = pipe(class_labels=[label], num_inference_steps=3, output_type="pt",
                     generator=sample_generators(4, [i])).images
        torch.testing.assert_close(alone[0], batch[i], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_diffusion_pipeline_loads_a_folder_and_a_hub_repository_in_a_fresh_process(
        tmp_path: Path) -> None:
    """diffusers' generic loader, as a user types it (README), in a new process that has
    not imported uvic: the folder's custom-pipeline entry brings `UViTPipeline`, for a
    saved folder and for a Hub repository (`"user/repo"`, here from the local Hub cache,
    offline); without `trust_remote_code=True` diffusers refuses to run the entry."""
    pipe = tiny_pipeline()
    pipe.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "model_index.json").read_text())["_class_name"] \
        == ["pipeline_uvit", "UViTPipeline"]
    snapshot = tmp_path / "hub" / "models--someone--tiny-uvit" / "snapshots" / ("0" * 40)
    pipe.save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    torch.save(images(pipe, [0, 3]), tmp_path / "want.pt")
    script = (
        "import sys, torch\n"
        "from diffusers import DiffusionPipeline\n"
        "assert 'uvic' not in sys.modules\n"
        "for name in ('saved', 'someone/tiny-uvit'):\n"
        "    pipe = DiffusionPipeline.from_pretrained(name, trust_remote_code=True)\n"
        "    pipe.set_progress_bar_config(disable=True)\n"
        "    from uvic.sampling.noise import sample_generators\n"
        "    out = pipe(class_labels=[0, 3], num_inference_steps=3, output_type='pt',\n"
        "               generator=sample_generators(0, range(2))).images\n"
        "    assert torch.equal(out, torch.load('want.pt')), name\n"
        "    print(type(pipe).__module__, type(pipe).__name__)\n"
        "try:\n"
        "    DiffusionPipeline.from_pretrained('saved')\n"
        "except ValueError as err:\n"
        "    assert 'trust_remote_code=True' in str(err)\n"
        "else:\n"
        "    raise AssertionError('ran a folder module without trust_remote_code')\n")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(tmp_path / "hub")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["uvic.pipelines.pipeline_uvit", "UViTPipeline"] * 2


def test_pipeline_overrides_no_private_diffusers_method(tmp_path: Path, monkeypatch) -> None:
    """`UViTPipeline` reads a folder through diffusers' public `load_config` (the pair
    `_class_name` read as this class) and a Hub repository through huggingface_hub's
    `snapshot_download` (here the local Hub cache, offline): no private method of
    diffusers is overridden, and no entry module runs (no trust_remote_code)."""
    from diffusers import DiffusionPipeline

    private = [n for n, v in vars(UViTPipeline).items() if callable(getattr(v, "__func__", v))
               and n.startswith("_") and not n.startswith("__") and hasattr(DiffusionPipeline, n)]
    assert private == []
    pipe = tiny_pipeline()
    snapshot = tmp_path / "hub" / "models--someone--tiny-uvit" / "snapshots" / ("0" * 40)
    pipe.save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    assert UViTPipeline.load_config(snapshot)["_class_name"] == "UViTPipeline"
    assert DiffusionPipeline.load_config(snapshot)["_class_name"] == [
        "pipeline_uvit", "UViTPipeline"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    for name in (snapshot, "someone/tiny-uvit"):
        loaded = UViTPipeline.from_pretrained(name)
        loaded.set_progress_bar_config(disable=True)
        assert type(loaded) is UViTPipeline
        assert torch.equal(images(loaded, [0, 2]), images(pipe, [0, 2]))
    assert not (tmp_path / "modules").exists()  # no module of the folder was imported
