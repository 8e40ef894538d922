"""The README's main job (`make quickstart` -> scripts/quickstart.py) at a reduced size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    cmd = [
        sys.executable, str(ROOT / "scripts" / "quickstart.py"), "--preset", "cpu",
        "--out", str(out), "--n-grid", "4", "--heldout", "32",
        "--set", "train.max_steps=20", "--set", "train.batch_size=8",
        "--set", "train.log_every=4", "--set", "train.sample_every=0",
        "--set", "train.ckpt_every=6", "--set", "data.num_images=64",
        "--set", "sample.steps=4", "--set", "eval.n_samples=8",
        "--set", "model.embed_dim=32", "--set", "model.depth=2",
        # No Inception weights: FID must be reported as skipped, never made up.
        "--set", f"eval.inception_path={tmp_path / 'absent' / 'inception-2015-12-05.pt'}",
    ]
    # A clean environment: in particular no TRITON_INTERPRET (set by conftest for the
    # kernel tests), so the CPU run takes the PyTorch attention path as a user's would.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    for name in ("grid.png", "loss.png", "results.md", "results.json", "config.json"):
        assert (out / name).is_file(), name
    results = json.loads((out / "results.json").read_text())
    rows = {r["model"]: r for r in results["rows"]}
    assert set(rows) == {"U-ViT", "U-ViC"}
    assert rows["U-ViT"]["pattern"] == "SSS"
    assert rows["U-ViC"]["pattern"] == "SCS"  # depth 2: first and last softmax, mid Cog
    for r in rows.values():
        assert np.isfinite(r["final_loss"]) and np.isfinite(r["heldout_loss"])
        assert r["ms_per_step"] > 0 and r["images_per_s"] > 0
        assert r["fid"] is None
    assert any("inception" in note.lower() for note in results["notes"])
    assert "skipped" in (out / "results.md").read_text()

    # The grid: two labelled panels side by side, 2x2 images of 64 px (32 px at 2x) each.
    grid = np.asarray(Image.open(out / "grid.png").convert("RGB")).astype(np.int16)
    height, width, _ = grid.shape
    panel = (width - 8) // 2
    assert panel >= 2 * 64 and height >= 2 * 64
    left, right = grid[:, :panel], grid[:, panel + 8: panel + 8 + panel]
    assert left.shape == right.shape
    # Same init, noise and data, different attention: the images differ (the header
    # labels differ too, so compare the image area below the header only). After a few
    # steps the two models are still close, so ask for differing pixels, not a margin.
    body = slice(height - 2 * 64, height)
    assert np.count_nonzero(left[body] != right[body]) > 0

    for preset in ("uvit", "uvic"):
        run = out / preset
        assert (run / "ema.safetensors").is_file()
        saved = json.loads((run / "config.json").read_text())
        assert saved["model"]["attention"] == preset
