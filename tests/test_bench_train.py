"""scripts/bench_train.py (a benchmark script, not a timed test): the model-FLOP count
behind its MFU, the device peaks, its JSON schema and its CPU smoke runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_script
from torch.utils.flop_counter import FlopCounterMode

import uvic_kernels
from uvic.config import ModelConfig, load_config
from uvic.models.flops import forward_flops, num_tokens, training_flops
from uvic.models.uvit import build_model

REPO = Path(__file__).resolve().parents[1]
RECORD_KEYS = {"dataset", "preset", "model", "backend", "compile", "batch",
               "grad_checkpointing", "tokens", "train_flops_per_image", "ms_per_step",
               "images_per_s", "mfu", "peak_mib", "status"}
RUN_KEYS = {"kind", "device", "device_type", "smoke", "peak_bf16_tflops", "python", "torch",
            "triton", "cuda", "date", "git_commit", "git_dirty", "steps", "warmup", "records",
            "table"}


def load_bench():
    return load_script("scripts/bench_train.py")


def plain_attention(q, k, v, mode, scale, *, bias=None, backend=None):
    """Attention as two visible matmuls (FlopCounterMode does not see inside the kernel)."""
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v


@pytest.mark.parametrize("arch", [
    dict(img_size=8, patch_size=2, embed_dim=32, depth=2, num_heads=2),  # CIFAR-like
    dict(img_size=8, patch_size=2, in_chans=4, embed_dim=48, depth=4, num_heads=3,
         num_classes=11, mlp_time_embed=True, conv=False, mlp_ratio=2.5),  # ImageNet H-like
    dict(img_size=8, patch_size=4, in_chans=4, embed_dim=32, depth=2, num_heads=2,
         clip_dim=12, num_clip_token=7, skip=False, qkv_bias=True),  # MS-COCO-like
])
def test_flop_count_matches_torchs_flop_counter(arch, monkeypatch) -> None:
    """forward_flops, from the config alone, equals what torch's FlopCounterMode counts
    (matmuls and convolutions) in a real forward, attention written as plain matmuls."""
    monkeypatch.setattr(uvic_kernels, "attention", plain_attention)
    m = ModelConfig(**arch, attention_backend="torch")
    model, batch = build_model(m), 3
    x = torch.randn(batch, m.in_chans, m.img_size, m.img_size)
    context = torch.randn(batch, m.num_clip_token, m.clip_dim) if m.clip_dim else None
    y = torch.randint(0, m.num_classes, (batch,)) if m.num_classes > 0 else None
    with FlopCounterMode(display=False) as counter:
        model(x, torch.rand(batch) * 999, context=context, y=y)
    assert forward_flops(m) * batch == counter.get_total_flops()
    assert training_flops(m) == 3 * forward_flops(m)


def test_flop_count_of_the_paper_models() -> None:
    """U-ViT-S/2 on CIFAR-10: ~73 GFLOP per image for a training step;
    the H/2 at ImageNet-256: 258 tokens (256 patches, time, label)."""
    cifar = load_config(REPO / "configs" / "cifar10_uvit.py").model
    assert num_tokens(cifar) == 257 and round(training_flops(cifar) / 1e9) == 73
    huge = load_config(REPO / "configs" / "imagenet256_uvit_huge.py").model
    assert num_tokens(huge) == 258 and huge.embed_dim == 1152


def test_peaks_and_mfu() -> None:
    from uvic.experiments import speed

    assert speed.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert speed.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert speed.peak_tflops("NVIDIA H200") == 989.4
    assert speed.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert speed.peak_tflops("NVIDIA GeForce RTX 4090") is None
    assert speed.mfu(73e9, 2298.0, 989.4) == pytest.approx(0.1696, abs=1e-4)
    assert speed.mfu(73e9, 2298.0, None) is None


def test_default_record_paths() -> None:
    """Both benchmarks' record files: kernels/results/<date>_<device>_<kind>.json of the
    checkout on a GPU, runs/bench/<kind>.json on a CPU (uvic.experiments.records)."""
    from uvic.experiments.records import default_out

    h100 = {"device": "NVIDIA H100 80GB HBM3", "device_type": "cuda",
            "date": "2026-11-24T01:02:03+00:00"}
    for kind in ("train", "sampling"):
        assert default_out(kind, h100) == (
            REPO / "kernels" / "results" / f"2026-11-24_nvidia-h100-80gb-hbm3_{kind}.json")
        assert default_out(kind, {**h100, "device": "x86_64", "device_type": "cpu"}) == (
            Path("runs/bench") / f"{kind}.json")


def test_bench_train_smoke(tmp_path, capsys):
    """Every default row on the CPU (our kernels' rows through PyTorch's path), the U-ViT-H/2
    rows without and with gradient checkpointing; the JSON's schema."""
    bench = load_bench()
    out = tmp_path / "train.json"
    assert bench.main(["--smoke", "--huge", "--steps", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    said = capsys.readouterr().out
    assert payload["smoke"] and "timings need a gpu" in said.lower()
    # one step after one warm-up measures the order the rows ran in: no ms shown
    assert "ms/step" not in said and "ms/step" not in payload["table"]
    assert said.count("ran (smoke: not a timing)") == len(payload["records"])
    assert set(payload) == RUN_KEYS and payload["kind"] == "train"
    assert payload["peak_bf16_tflops"] is None
    assert payload["torch"] == torch.__version__ and len(payload["git_commit"]) == 40
    rows = payload["records"]
    cells = [(r["dataset"], r["model"], r["backend"], r["grad_checkpointing"]) for r in rows]
    assert cells == [(d, m, b, False) for d in ("cifar10", "mscoco") for m, bs in
                     (("uvit", ("torch", "sdpa")), ("uvic", ("torch",))) for b in bs] + [
        ("imagenet256", "uvit", b, ckpt) for ckpt in (False, True) for b in ("torch", "sdpa")]
    for r in rows:
        assert set(r) == RECORD_KEYS and r["status"] == "ok" and r["compile"] == "off"
        assert r["ms_per_step"] > 0 and r["images_per_s"] == pytest.approx(
            r["batch"] / r["ms_per_step"] * 1e3) and r["mfu"] is None and r["peak_mib"] is None
    assert rows[0]["tokens"] == 17  # 8x8 smoke images, patch 2
    assert "| cifar10 (17) | uvic | torch | off | no | 2 | yes |" in payload["table"]
    assert "| imagenet256 (18) | uvit | sdpa | off | yes | 2 | yes |" in payload["table"]


@pytest.mark.slow
def test_bench_train_compiled_row_and_options(tmp_path, capsys):
    """A compile mode's row (reduce-overhead: on a CPU without CUDA graphs, said once)
    beside eager; the options refuse unknown values in one line."""
    bench = load_bench()
    out = tmp_path / "train.json"
    assert bench.main(["--smoke", "--datasets", "cifar10", "--models", "uvit", "--backends",
                       "sdpa", "--compile", "off,reduce-overhead", "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("CUDA graphs need a CUDA device") == 1
    rows = json.loads(out.read_text())["records"]
    assert [(r["backend"], r["compile"], r["status"]) for r in rows] == [
        ("sdpa", "off", "ok"), ("sdpa", "reduce-overhead", "ok")]
    for flag, value, message in [("--backends", "sdpa,flash", "unknown value 'flash'"),
                                 ("--compile", "off,fast", "unknown value 'fast'"),
                                 ("--datasets", "imagenet", "unknown value 'imagenet'")]:
        with pytest.raises(SystemExit) as exc:
            bench.main(["--smoke", flag, value, "--out", str(out)])
        assert exc.value.code == 2 and f"{flag}: {message}" in capsys.readouterr().err


def test_a_failing_profile_keeps_the_timing(monkeypatch) -> None:
    """A profiler failure is the record's `profile_error`; its timing stays."""
    from uvic.experiments import speed

    def broken(step, device):
        raise RuntimeError("profiler unavailable\nmore")

    monkeypatch.setattr(speed, "profile_step", broken)
    cell = speed.Cell("cifar10", "cifar10_uvit", "uvit", "sdpa", "off", 2)
    record = speed.run_cell(cell, 1, 1, torch.device("cpu"), None, profile=True)
    assert record["status"] == "ok" and record["ms_per_step"] > 0
    assert record["profile_error"] == "RuntimeError: profiler unavailable"


def test_profile_step_counts_the_step_operators() -> None:
    """The profile of a step of known work: its operators and calls per step, and the
    host time of their own within the wall time; no GPU figures on a CPU."""
    from uvic.experiments.profile import profile_lines, profile_step

    a = torch.randn(64, 64)

    def step() -> None:
        for _ in range(3):
            torch.mm(a, a)
        torch.add(a, a)

    record = profile_step(step, torch.device("cpu"), steps=4)
    calls = {op["name"]: op["calls"] for op in record["host_top"]}
    assert calls["aten::mm"] == 3 and calls["aten::add"] == 1
    assert 0 < record["host_ms"] <= record["wall_ms"]
    assert record["device_ms"] is None and record["gpu_busy"] is None
    assert record["kernels_top"] == []
    lines = profile_lines("step", record)
    assert "GPU busy n/a" in lines[0] and any("aten::mm" in line for line in lines)


@pytest.mark.slow
def test_bench_train_profile_row(tmp_path, capsys):
    """--profile adds each row's profile to its record and prints it."""
    bench = load_bench()
    out = tmp_path / "train.json"
    assert bench.main(["--smoke", "--datasets", "cifar10", "--models", "uvic", "--profile",
                       "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["records"]
    assert set(row) == RECORD_KEYS | {"profile"}
    names = {op["name"] for op in row["profile"]["host_top"]}
    assert any(name.startswith("aten::") for name in names)
    assert "profile of cifar10 uvic torch compile=off" in capsys.readouterr().out


def test_make_gpu_results_commands_parse() -> None:
    """`make gpu-results` (the GPU session's measurements) names only flags and values
    its three benchmark programs accept."""
    import shlex

    from uvic.cli import bench_sampling, bench_train
    from uvic_kernels import bench as kernel_bench

    recipe = (REPO / "Makefile").read_text().split("\ngpu-results:\n")[1].split("\n\n")[0]
    commands = [shlex.split(line.strip())[1:] for line in recipe.splitlines()]
    programs = {"-m": lambda argv: kernel_bench.parse_args(argv[1:]),
                "scripts/bench_train.py": bench_train.parse_args,
                "scripts/bench_sampling.py": bench_sampling.parse_args}
    assert [argv[0] for argv in commands] == list(programs)
    for argv in commands:
        programs[argv[0]](argv[1:])  # an unknown flag or value exits 2


def fake_release(root: Path) -> Path:
    """A checkout laid out as the U-ViT release's (libs/ a package, libs/uvit.py's UViT
    taking the release's arguments and called as model(x, t)), wrapping uvic's U-ViT."""
    libs = root / "libs"
    libs.mkdir(parents=True)
    (libs / "__init__.py").write_text("")
    (libs / "helper.py").write_text("SCALE = 1.0\n")
    (libs / "uvit.py").write_text(
        "from .helper import SCALE\n"
        "from uvic.models.uvit import UViT as Ours\n"
        "class UViT(Ours):\n"
        "    def __init__(self, qkv_bias, mlp_time_embed, num_classes, **arch):\n"
        "        super().__init__(**arch, attention_backend='torch')\n"
        "    def forward(self, x, t):\n"
        "        return super().forward(x, t, return_dict=False)[0] * SCALE\n")
    return root


def test_release_side_by_side_times_every_model_in_turn(tmp_path: Path, monkeypatch) -> None:
    from uvic.cli import bench_release

    monkeypatch.setitem(bench_release.SIZES, "quickstart", (
        {"img_size": 8, "patch_size": 2, "embed_dim": 16, "depth": 2, "num_heads": 2,
         "mlp_ratio": 2.0}, 2))
    rows = bench_release.side_by_side(fake_release(tmp_path / "uvit"), "quickstart",
                                      ["uvit", "uvic"], rounds=3, warmup=1)
    assert [r["model"] for r in rows] == ["release", "uvit", "uvic"]
    assert rows[0]["ratio_to_release"] == 1.0 and all(r["ms_per_step"] > 0 for r in rows)
    assert all(r["rounds"] == 3 and r["ms_min"] <= r["ms_per_step"] for r in rows)
    assert "| quickstart (2) | uvic |" in bench_release.table(rows, 1)


def test_release_flag_needs_a_checkout(tmp_path: Path, capsys) -> None:
    bench = load_bench()
    with pytest.raises(SystemExit) as exit:
        bench.main(["--release", str(tmp_path)])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --release {tmp_path}: no libs/uvit.py") and err.count("\n") == 1
