"""uvic's U-ViT as a diffusers model and pipeline: save/load round
trips, the pipeline against uvic's own sampler (`uvic-sample` and `sample_images`) for
each kind of model, scheduler swapping, export from each source, a fresh-process load of
an exported folder, and one-line errors. Tiny random models (CPU, attention in PyTorch)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from datagen import tiny_clip_folder, tiny_vae_folder
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, UniPCMultistepScheduler
from PIL import Image

from uvic.cli.export import main as export_main
from uvic.cli.sample import main as sample_main
from uvic.config import Config, load_config
from uvic.diffusion.samplers import make_scheduler
from uvic.diffusion.schedule import Diffusion
from uvic.files import save_config
from uvic.models.text_encoder import ClipTextEncoder
from uvic.models.uvit import UViT, build_model
from uvic.pipelines import UViTPipeline
from uvic.pipelines.export import export
from uvic.run.architecture import model_metadata
from uvic.run.folder import RunFolder
from uvic.run.weights import load_weights, read_state_dict, save_safetensors
from uvic.sampling.assets import model_to_pixels
from uvic.sampling.generate import sample_images
from uvic.sampling.images import to_uint8
from uvic.sampling.noise import make_noise, sample_generators

REPO = Path(__file__).resolve().parents[1]
# 32x32 pixels (CIFAR-size) in patches of 8; latents 4x8x8 (64 px images) in patches of 2
TINY = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2",
        "model.attention_backend=torch", "sample.batch_size=8"]
PIXELS = [*TINY, "model.img_size=32", "model.patch_size=8", "sample.steps=4"]
LATENTS = [*TINY, "model.img_size=8", "model.patch_size=2", "model.clip_dim=32",
           "sample.steps=3"]


def perturbed(cfg: Config, seed: int) -> UViT:
    """A random model whose every weight (zero biases, unit norms too) is off its init."""
    torch.manual_seed(seed)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def write_run(folder: Path, cfg: Config, seed: int) -> Path:
    """A run folder as training leaves it: config.json and ema.safetensors (with the model
    config in its metadata), and a checkpoint folder holding the same EMA."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=str(folder)))
    model = perturbed(cfg, seed)
    save_config(cfg, folder / "config.json")
    save_safetensors(model, folder / RunFolder.EMA, metadata=model_metadata(cfg.model))
    step = folder / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    shutil.copyfile(folder / RunFolder.EMA, step / RunFolder.EMA)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three runs (unconditional CIFAR-10-style pixels, class-conditional, text-to-image
    latents with a tiny VAE and CLIP) and their exported pipeline folders."""
    root = tmp_path_factory.mktemp("hub")
    vae, clip = tiny_vae_folder(root / "vae"), tiny_clip_folder(root / "clip")
    offline = [f"data.vae={vae}", f"data.clip_model={clip}", "data.clip_pretrained=",
               f"data.root={root / 'no_features'}"]
    cfgs = {
        "pixels": load_config(REPO / "configs/cifar10_uvic.py", PIXELS),
        "classes": load_config(REPO / "configs/cifar10_uvic.py",
                               [*PIXELS, "model.num_classes=5", "sample.scheduler=dpm_solver++"]),
        "text": load_config(REPO / "configs/mscoco_uvic.py", [*LATENTS, *offline]),
    }
    paths = {"root": root, "vae": vae, "clip": Path(clip.removeprefix("local-dir:"))}
    for seed, (kind, cfg) in enumerate(cfgs.items()):
        paths[kind] = write_run(root / "runs" / kind, cfg, seed)
        null = 4 if kind == "classes" else None
        paths[f"{kind} pipeline"] = export(paths[kind], root / "exported" / kind, null_class=null)
    return paths


def pipeline(runs: dict[str, Path], kind: str) -> UViTPipeline:
    """An exported pipeline, attention in PyTorch as the runs have it (an export leaves the
    backend to the loader: "auto", which under the tests' TRITON_INTERPRET=1 is Triton's
    interpreter, equal to float rounding only)."""
    pipe = UViTPipeline.from_pretrained(runs[f"{kind} pipeline"])
    pipe.transformer.set_attention(pipe.transformer.attention_modes, backend="torch")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_model(runs: dict[str, Path], kind: str) -> tuple[Config, UViT]:
    """The run's config and its EMA model, loaded the way uvic-sample loads it."""
    cfg = load_config(runs[kind] / "config.json")
    model = build_model(cfg.model).eval()
    load_weights(model, runs[kind] / RunFolder.EMA)
    return cfg, model


def pngs(folder: Path) -> np.ndarray:
    return np.stack([np.asarray(Image.open(p)) for p in sorted(folder.glob("*.png"))])


def arrays(images: list[Image.Image]) -> np.ndarray:
    return np.stack([np.asarray(image) for image in images])


def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as err:
        call(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- the model


@pytest.mark.parametrize("extra", [
    ["model.attention=uvic"],
    ["model.attention=softmax,expressive,cog", "model.num_classes=5"],
    ["model.attention=uvit", "model.clip_dim=16", "model.num_clip_token=5",
     "model.pos_embed_init=sincos", "model.mlp_time_embed=true", "model.qkv_bias=true"],
])
def test_save_pretrained_round_trip_is_bit_identical(tmp_path: Path, extra: list[str]) -> None:
    cfg = load_config(REPO / "configs/cifar10_uvic.py", [*PIXELS, *extra])
    model = perturbed(cfg, 0)
    model.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "config.json", "diffusion_pytorch_model.safetensors"]
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    # the config is uvic's ModelConfig, field for field
    assert {k: v for k, v in saved.items() if not k.startswith("_")} == json.loads(
        json.dumps(dataclasses.asdict(cfg.model)))
    for low_cpu_mem_usage in (True, False):  # accelerate's empty-weights init, and plain
        loaded = UViT.from_pretrained(tmp_path / "m", low_cpu_mem_usage=low_cpu_mem_usage)
        assert loaded.attention_modes == model.attention_modes
        a, b = model.state_dict(), loaded.state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        x, t = torch.randn(3, 3, 32, 32), torch.tensor([1.0, 400.0, 999.0])
        inputs = {}
        if cfg.model.num_classes > 0:
            inputs["y"] = torch.tensor([0, 3, 4])
        if cfg.model.clip_dim > 0:
            inputs["context"] = torch.randn(3, 5, 16)
        with torch.no_grad():
            assert torch.equal(model(x, t, **inputs).sample, loaded.eval()(x, t, **inputs).sample)


def test_set_attention_and_backend_reach_the_saved_config(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs/cifar10_uvic.py", PIXELS)
    model = perturbed(cfg, 0)
    model.set_attention(["cog", "softmax", "expressive"], backend="auto")
    model.save_pretrained(tmp_path / "m")
    loaded = UViT.from_pretrained(tmp_path / "m")
    assert loaded.attention_modes == ["cog", "softmax", "expressive"]
    assert loaded.config.attention_backend == "auto" and loaded.in_blocks[0].attn.backend is None
    # a runtime choice at load time, as for any diffusers model
    torch_backend = UViT.from_pretrained(tmp_path / "m", attention_backend="torch")
    assert torch_backend.mid_block.attn.backend == "torch"


def test_release_state_dicts_still_load_strictly(tmp_path: Path) -> None:
    """The release's parameter names: a .pth of them loads strictly into a model that
    from_pretrained built, and the saved safetensors holds the same names."""
    cfg = load_config(REPO / "configs/cifar10_uvit.py", PIXELS)
    release = perturbed(cfg, 1).state_dict()
    torch.save(release, tmp_path / "nnet_ema.pth")
    perturbed(cfg, 0).save_pretrained(tmp_path / "m")
    model = UViT.from_pretrained(tmp_path / "m")
    load_weights(model, tmp_path / "nnet_ema.pth", strict=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in release.items())
    saved = read_state_dict(tmp_path / "m" / "diffusion_pytorch_model.safetensors")
    assert set(saved) == set(release)


def test_diffusers_gradient_checkpointing_is_uvics() -> None:
    cfg = load_config(REPO / "configs/cifar10_uvic.py", PIXELS)
    model = perturbed(cfg, 0).train()
    x, t = torch.randn(2, 3, 32, 32), torch.tensor([5.0, 500.0])

    def grads() -> list[torch.Tensor]:
        model.zero_grad()
        model(x, t).sample.square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    model.enable_gradient_checkpointing()
    assert model.grad_checkpointing and model.is_gradient_checkpointing
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, grads()))
    model.disable_gradient_checkpointing()
    assert not model.grad_checkpointing


# --------------------------------------------------------------------------- the pipeline


@pytest.mark.parametrize("sampler", ["euler_maruyama", None])
def test_unconditional_pipeline_equals_uvic_sample(runs, tmp_path: Path, sampler) -> None:
    """The run's protocol (Euler-Maruyama, stochastic: step noise from the per-sample
    generators) by name, and the pipeline's saved scheduler (DPM-Solver++), against
    uvic-sample's PNGs with the same seed."""
    run = runs["pixels"]
    scheduler = sampler or "dpm_solver++"
    assert sample_main(["--config", str(run / "config.json"), "--ckpt", str(run / RunFolder.EMA),
                        "--n", "3", "--seed", "7", "--scheduler", scheduler,
                        "--save-individual", "--quiet", "--out", str(tmp_path / "s")]) == 0
    pipe = pipeline(runs, "pixels")
    assert isinstance(pipe.scheduler, DPMSolverMultistepScheduler)
    images = pipe(batch_size=3, num_inference_steps=4, sampler=sampler,
                  generator=sample_generators(7, range(3))).images
    assert [image.size for image in images] == [(32, 32)] * 3
    np.testing.assert_array_equal(arrays(images), pngs(tmp_path / "s" / "samples"))


@pytest.mark.slow
def test_text_to_image_pipeline_equals_uvic_sample(runs, tmp_path: Path) -> None:
    """Prompts through the release's tokenization and CLIP states, guidance s = 1 (g = 2)
    against the empty caption, DPM-Solver "fast" (the MS-COCO protocol), VAE decoding."""
    run = runs["text"]
    (tmp_path / "prompts.txt").write_text("a red bus\na dog on a surfboard\n")
    assert sample_main(["--config", str(run / "config.json"), "--ckpt", str(run / RunFolder.EMA),
                        "--prompts", str(tmp_path / "prompts.txt"), "--n", "4", "--seed", "2",
                        "--cfg-scale", "1.0", "--save-individual", "--quiet",
                        "--out", str(tmp_path / "s")]) == 0
    pipe = pipeline(runs, "text")
    assert pipe.config.cfg_scale == 1.0 and pipe.vae is not None
    prompts = ["a red bus", "a dog on a surfboard"]
    generators = sample_generators(2, range(4))
    images = pipe(prompts, num_images_per_prompt=2, num_inference_steps=3, guidance_scale=2.0,
                  sampler="dpm_solver++_fast_time_uniform", generator=generators).images
    assert [image.size for image in images] == [(64, 64)] * 4
    expected = pngs(tmp_path / "s" / "samples")
    np.testing.assert_array_equal(arrays(images), expected)
    # the release's s directly, and the pipeline's default guidance (the run's s = 1)
    for guidance in ({"cfg_scale": 1.0}, {}):
        again = pipe(prompts, num_images_per_prompt=2, num_inference_steps=3,
                     sampler="dpm_solver++_fast_time_uniform",
                     generator=sample_generators(2, range(4)), **guidance).images
        np.testing.assert_array_equal(arrays(again), expected)

    # a negative prompt: uvic's guidance with that caption's states as the unconditional
    cfg, model = run_model(runs, "text")
    encoder = ClipTextEncoder(cfg.data.clip_model, None)
    noise = make_noise((4, 8, 8), sample_generators(2, range(2)))
    x0 = sample_images(model, Diffusion(cfg.diffusion), noise, context=encoder.encode(prompts),
                       uncond_context=encoder.encode(["blurry"] * 2), cfg_scale=0.5,
                       scheduler="dpm_solver++", steps=3)
    got = pipe(prompts, negative_prompt="blurry", num_inference_steps=3, cfg_scale=0.5,
               latents=noise, output_type="latent").images
    assert torch.equal(got, x0)
    # prompt_embeds (e.g. a feature folder's contexts) in place of prompts
    embeds = pipe(prompt_embeds=encoder.encode(prompts), num_inference_steps=3, cfg_scale=0.5,
                  negative_prompt_embeds=encoder.encode(["blurry"] * 2), latents=noise,
                  output_type="latent").images
    assert torch.equal(embeds, x0)


def test_class_conditional_pipeline_equals_uvic_sampler(runs) -> None:
    """Class labels, guided against the null class (s = 1.5, g = 2.5) and unguided, against
    uvic's sample_images; the output types and return_dict of diffusers."""
    cfg, model = run_model(runs, "classes")
    pipe = pipeline(runs, "classes")
    assert pipe.config.null_class == 4 and pipe.config.cfg_scale == 0.0
    diffusion = Diffusion(cfg.diffusion)
    noise = make_noise((3, 32, 32), sample_generators(1, range(4)))
    labels = torch.tensor([0, 0, 3, 3])
    for s in (1.5, 0.0):
        x0 = sample_images(model, diffusion, noise, y=labels, uncond_y=4, cfg_scale=s,
                           scheduler="dpm_solver++", steps=4)
        pt = pipe(class_labels=[0, 3], num_images_per_prompt=2, guidance_scale=s + 1,
                  num_inference_steps=4, generator=sample_generators(1, range(4)),
                  output_type="pt").images
        assert torch.equal(pt, model_to_pixels(x0))
    unguided = pt
    (as_np,) = pipe(class_labels=[0, 3], num_images_per_prompt=2, num_inference_steps=4,
                    latents=noise, output_type="np", return_dict=False)
    assert as_np.shape == (4, 32, 32, 3)
    np.testing.assert_array_equal(as_np, unguided.permute(0, 2, 3, 1).numpy())
    pil = pipe(class_labels=torch.tensor([0, 3]), num_images_per_prompt=2, num_inference_steps=4,
               latents=noise).images
    np.testing.assert_array_equal(arrays(pil), to_uint8(unguided).numpy())
    # one torch generator (diffusers' way): reproducible, and not uvic's per-sample noise
    one = [pipe(class_labels=[1, 2], num_inference_steps=2, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images for _ in range(2)]
    assert torch.equal(*one)


def test_half_precision_pipeline_runs_under_autocast(runs) -> None:
    """A pipeline loaded in bfloat16 (diffusers' dtype=) samples under autocast, the solver
    in float32, close to the float32 pipeline."""
    full = pipeline(runs, "classes")
    half = UViTPipeline.from_pretrained(runs["classes pipeline"], dtype=torch.bfloat16)
    half.transformer.set_attention(half.transformer.attention_modes, backend="torch")
    half.set_progress_bar_config(disable=True)
    assert half.transformer.dtype == torch.bfloat16
    noise = make_noise((3, 32, 32), sample_generators(0, range(2)))
    a, b = (p(class_labels=[1, 2], num_inference_steps=3, latents=noise, output_type="pt",
              guidance_scale=2.0).images for p in (full, half))
    assert b.dtype == torch.float32 and (a - b).abs().mean() < 0.02


def test_swapped_scheduler_runs_through_uvics_loop(runs, tmp_path: Path) -> None:
    cfg, model = run_model(runs, "pixels")
    diffusion = Diffusion(cfg.diffusion)
    pipe = pipeline(runs, "pixels")
    noise = make_noise((3, 32, 32), sample_generators(0, range(2)))
    before = pipe(batch_size=2, num_inference_steps=4, latents=noise, output_type="pt").images

    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    after = pipe(batch_size=2, num_inference_steps=4, latents=noise, output_type="pt").images
    own = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    x0 = sample_images(model, diffusion, noise, scheduler=own, steps=4)
    assert torch.equal(after, model_to_pixels(x0))
    assert (after - before).abs().max() > 1e-3  # another solver, another result
    # the swap is saved with the pipeline
    pipe.save_pretrained(tmp_path / "unipc")
    reloaded = UViTPipeline.from_pretrained(tmp_path / "unipc")
    assert isinstance(reloaded.scheduler, UniPCMultistepScheduler)
    assert torch.equal(reloaded(batch_size=2, num_inference_steps=4, latents=noise,
                                output_type="pt").images, after)
    # a scheduler by name, built for the schedule as uvic-sample --scheduler builds it
    named = pipe(batch_size=2, num_inference_steps=4, latents=noise, sampler="DDIMScheduler",
                 output_type="latent").images
    assert torch.equal(named, sample_images(model, diffusion, noise, scheduler="DDIMScheduler",
                                            steps=4))
    ddim = make_scheduler(diffusion, "DDIMScheduler")
    assert isinstance(ddim, DDIMScheduler) and not ddim.config.clip_sample


# --------------------------------------------------------------------------- export


def loaded_weights(folder: Path) -> dict[str, torch.Tensor]:
    return UViT.from_pretrained(folder / "transformer").state_dict()


def test_export_from_each_source(runs, tmp_path: Path) -> None:
    run = runs["pixels"]
    expected = read_state_dict(run / RunFolder.EMA)
    release_cfg = load_config(REPO / "configs/cifar10_uvit.py", PIXELS)
    release = perturbed(release_cfg, 5).state_dict()
    torch.save(release, tmp_path / "nnet_ema.pth")
    shutil.copyfile(run / RunFolder.EMA, tmp_path / "copied.safetensors")
    uvit_config = tmp_path / "uvit.json"
    save_config(release_cfg, uvit_config)
    sources = {  # source, --config, expected weights, expected attention
        "run": (run, None, expected, "uvic"),
        "checkpoint folder": (run / "checkpoints" / "step_000002", None, expected, "uvic"),
        "checkpoint file": (run / "checkpoints" / "step_000002" / RunFolder.EMA, None, expected,
                            "uvic"),
        # a copied EMA knows its architecture: the uvit config gives only the schedule etc.
        "copied file": (tmp_path / "copied.safetensors", uvit_config, expected, "uvic"),
        "release": (tmp_path / "nnet_ema.pth", REPO / "configs/cifar10_uvit.py", release,
                    "uvit"),
    }
    for name, (source, config, weights, attention) in sources.items():
        out = tmp_path / name.replace(" ", "_")
        args = [str(source), "--out", str(out), *(["--config", str(config)] if config else [])]
        if name == "release":
            args += [f"--set={o}" for o in PIXELS]
        assert export_main(args) == 0, name
        got = loaded_weights(out)
        assert all(torch.equal(got[k], v) for k, v in weights.items()) and set(got) == set(
            weights), name
        transformer = json.loads((out / "transformer" / "config.json").read_text())
        assert transformer["attention"] == attention, name
        assert transformer["attention_backend"] == "auto", name  # the loader's choice
        index = json.loads((out / "model_index.json").read_text())
        # the class as diffusers' custom pipelines name it: [entry module, class]
        assert index["_class_name"] == ["pipeline_uvit", "UViTPipeline"]
        assert index["vae"] == [None, None]
        assert index["diffusion"]["schedule"] == "vp_continuous"


def test_exported_text_pipeline_is_self_contained(runs) -> None:
    folder = runs["text pipeline"]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["vae"] == ["diffusers", "AutoencoderKL"] and (folder / "vae").is_dir()
    assert index["clip_model"] == f"local-dir:{runs['clip'].resolve()}"
    assert index["diffusion"]["schedule"] == "scaled_linear"
    assert index["scale_factor"] == 0.2301 and index["cfg_scale"] == 1.0
    # the run's release fast DPM-Solver is uvic's: saved as DPM-Solver++ of the run's order
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "DPMSolverMultistepScheduler"
    assert scheduler["algorithm_type"] == "dpmsolver++" and scheduler["use_lu_lambdas"]


def test_export_refuses_what_it_cannot_export(runs, tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    torch.save(perturbed(load_config(REPO / "configs/cifar10_uvit.py", PIXELS), 0).state_dict(),
               tmp_path / "nnet_ema.pth")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    cases = {
        str(runs["pixels pipeline"]): "is not a uvic run or checkpoint folder",  # a pipeline
        str(tmp_path / "notes.txt"): "is not a checkpoint",
        str(tmp_path / "nnet_ema.pth"): "records no model config",
        str(tmp_path / "missing"): "export source not found",
        str(runs["vae"] / "diffusion_pytorch_model.safetensors"): "config.json",
    }
    for source, says in cases.items():
        assert export_main([source, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and says in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "out").exists()
    # the wrong architecture for a release file: the mismatch, named in one line
    assert export_main([str(tmp_path / "nnet_ema.pth"), "--out", str(tmp_path / "out"),
                        "--config", str(REPO / "configs/cifar10_uvit.py")]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not fit UViT" in err and len(err.splitlines()) == 1
    # an output folder in use is left alone
    assert export_main([str(runs["pixels"]), "--out", str(tmp_path / "full")]) == 2
    assert "refusing to write into" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_fresh_process_loads_an_export_and_samples_with_a_swapped_scheduler(
        runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A U-ViC exported, its run folder gone, loaded in a new Python process with
    from_pretrained and sampled with another diffusers scheduler: uvic's sampler's images
    (here with the default backend as a user's CPU picks it, as in the new process)."""
    from uvic_kernels import fused_attention

    run = shutil.copytree(runs["pixels"], tmp_path / "run")
    cfg, model = run_model({"pixels": run}, "pixels")
    monkeypatch.setattr(fused_attention, "_interpret_requested", lambda: False)
    model.set_attention(model.attention_modes, backend="auto")
    assert export_main([str(run), "--out", str(tmp_path / "exported")]) == 0
    shutil.rmtree(run)
    script = (
        "import sys, numpy as np\n"
        "from diffusers import DPMSolverMultistepScheduler\n"
        "from uvic.pipelines import UViTPipeline\n"
        "from uvic.sampling.noise import sample_generators\n"
        "pipe = UViTPipeline.from_pretrained('exported')\n"
        "pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, "
        "solver_order=3)\n"
        "out = pipe(batch_size=2, num_inference_steps=5, output_type='np',\n"
        "           generator=sample_generators(9, range(2))).images\n"
        "np.save('images.npy', out)\n"
        "print(type(pipe.transformer).__name__, pipe.transformer.attention_modes)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a user's: torch
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UViT ['softmax', 'cog', 'softmax']" in proc.stdout
    third_order = make_scheduler(Diffusion(cfg.diffusion), "dpm_solver++", order=3, steps=5)
    x0 = sample_images(model, Diffusion(cfg.diffusion), make_noise(
        (3, 32, 32), sample_generators(9, range(2))), scheduler=third_order, steps=5)
    np.testing.assert_array_equal(np.load(tmp_path / "images.npy"),
                                  model_to_pixels(x0).permute(0, 2, 3, 1).numpy())


# --------------------------------------------------------------------------- bad input


def test_pipeline_refuses_bad_input_in_one_line(runs) -> None:
    pixels, classes, text = (pipeline(runs, k) for k in ("pixels", "classes", "text"))
    assert "takes no text" in one_line_error(pixels, "a red bus", num_inference_steps=1)
    assert "class_labels given" in one_line_error(pixels, class_labels=[1])
    assert "needs a conditional model" in one_line_error(pixels, guidance_scale=3.0)
    assert "in [0, 5): got 5" in one_line_error(classes, class_labels=[1, 5])
    assert "in [0, 5): got -1" in one_line_error(classes, class_labels=[-1])
    assert "must be integers" in one_line_error(classes, class_labels=[1.5])
    assert "needs class_labels" in one_line_error(classes)
    assert "batch_size is for unconditional" in one_line_error(classes, class_labels=[1],
                                                               batch_size=2)
    no_null = UViTPipeline(classes.transformer, classes.scheduler,
                           diffusion=classes.config.diffusion, cfg_scale=1.0)
    assert "null class" in one_line_error(no_null, class_labels=[1])
    assert "not both" in one_line_error(classes, class_labels=[1], guidance_scale=2.0,
                                        cfg_scale=1.0)
    assert "needs a prompt" in one_line_error(text)
    assert "2 entries for 1 prompts" in one_line_error(text, "a bus", negative_prompt=["a", "b"])
    assert "latents must have shape (2, 3, 32, 32)" in one_line_error(
        pixels, batch_size=2, latents=torch.zeros(2, 3, 8, 8))
    assert "3 generators for 2 images" in one_line_error(
        pixels, batch_size=2, generator=sample_generators(0, range(3)))
    assert "output_type" in one_line_error(pixels, output_type="png")
    assert "DDIM" in one_line_error(pixels, sampler="DDIM")


# --------------------------------------------------------------------------- the docs


@pytest.mark.slow
def test_readme_examples_run(runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/diffusers.md's Python examples run as written on the exported
    tiny runs (at 2 steps and 2 images), in a folder holding them where the page puts
    them."""
    section = (REPO / "docs" / "diffusers.md").read_text()
    examples = [code for code in re.findall(r"```python\n(.*?)```", section, flags=re.S)
                if "UViTPipeline" in code]
    assert examples
    for name, kind in (("cifar10_uvic", "pixels"), ("mscoco_uvic", "text")):
        shutil.copytree(runs[f"{kind} pipeline"], tmp_path / "exported" / name)
    monkeypatch.chdir(tmp_path)
    for code in examples:
        code = re.sub(r"num_inference_steps=\d+", "num_inference_steps=2", code)
        code = re.sub(r"batch_size=\d+", "batch_size=2", code)
        namespace: dict = {}
        exec(compile(code, "docs/diffusers.md", "exec"), namespace)
    assert Image.open(tmp_path / "red_bus.png").size == (64, 64)
