"""Massive activations per block (Gu et al. 2024, Figure 29): the measure by hand, on
hidden states set through a hook, captured in the attention pass, for every mode."""

from __future__ import annotations

import json

import pytest
import torch
from test_analysis import tiny_cfg, tiny_model

from uvic.analysis import analyze, check_result, load_inputs, save_figures
from uvic.analysis.massive import (
    massive_activation,
    massive_table,
    pooled,
    summarize,
    token_kind,
    token_name,
)


def test_measure_by_hand():
    """Norms (3, 4, 12, 0, 5) -> the largest is token 2, the others' mean (3+4+0+5)/4 = 3."""
    hidden = torch.zeros(2, 5, 3)
    hidden[0, 0, 0], hidden[0, 1, 1], hidden[0, 2] = 3.0, 4.0, torch.tensor([4.0, -8.0, 8.0])
    hidden[0, 4, :2] = torch.tensor([3.0, 4.0])
    hidden[1] = 1.0  # all tokens alike: the first one counts as the largest, ratio 1
    ratio, index = massive_activation(hidden)
    assert ratio.dtype == torch.float64
    assert ratio.tolist() == pytest.approx([12.0 / 3.0, 1.0])
    assert index.tolist() == [2, 0]
    assert massive_activation(torch.zeros(1, 3, 2))[0].item() == 0.0  # no division by zero
    with pytest.raises(ValueError, match="N >= 2"):
        massive_activation(torch.ones(1, 1, 4))


def test_summary_and_token_kinds():
    layout = {"num_tokens": 10, "num_extras": 4, "time_index": 1, "text": [2, 4],
              "grid": [2, 3]}  # [label, time, text, text, 6 patches]
    kinds = [token_kind(i, layout) for i in range(6)]
    assert kinds == ["label", "time", "text", "text", "patch", "patch"]
    assert [token_name(i, layout) for i in (1, 3, 8)] == ["time", "text 1", "patch (1, 1)"]
    summary = summarize(torch.tensor([2.0, 4.0, 6.0]), torch.tensor([8, 1, 8]), layout)
    assert summary["ratio"] == pytest.approx(4.0)
    assert summary["ratio_std"] == pytest.approx((8 / 3) ** 0.5)  # over the images
    assert summary["tokens"] == [{"index": 8, "kind": "patch", "images": 2},
                                 {"index": 1, "kind": "time", "images": 1}]
    # two levels (2, 4, 6) and (1, 1, 1): pooled over the six values
    block = {"massive_ratio": [4.0, 1.0], "massive_ratio_std": [(8 / 3) ** 0.5, 0.0]}
    values = torch.tensor([2.0, 4.0, 6.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    assert pooled(block) == pytest.approx((values.mean().item(), values.std(correction=0).item()))


def _set_block_output(massive: int, scales: list[float]):
    """A forward hook that replaces a block's output: token j gets norm 1 + j % 3 (along
    the first axis), token `massive` norm scales[b] in image b (along the second)."""
    def hook(module, args, output):
        hidden = torch.zeros_like(output)
        tokens = hidden.shape[1]
        hidden[:, :, 0] = 1.0 + torch.arange(tokens) % 3
        hidden[:, massive, 0] = 0.0
        hidden[:, massive, 1] = torch.tensor(scales[: hidden.shape[0]])
        return hidden
    return hook


def test_known_massive_tokens_through_the_hooks():
    """Hidden states with a known massive token, set by a hook that runs before the
    recorder's: the result has the hand-computed ratio, its spread and the token."""
    cfg = tiny_cfg("uvic")
    model = tiny_model("uvic")  # 17 tokens: time, then 4 x 4 patches
    images, _ = load_inputs(cfg, 3)
    scales = [20.0, 30.0, 55.0]
    handles = [model.blocks()[1].register_forward_hook(_set_block_output(6, scales)),
               model.blocks()[2].register_forward_hook(_set_block_output(0, scales))]
    calls = []
    handles.append(model.register_forward_hook(lambda *_: calls.append(1)))
    try:
        result = analyze({"U-ViC": model}, cfg, images, num_levels=2, batch_size=3)
    finally:
        for handle in handles:
            handle.remove()
    check_result(result)
    assert len(calls) == 2  # one forward pass per level: attention and activations together
    blocks = result["models"]["U-ViC"]["blocks"]
    for blk, massive in ((blocks[1], 6), (blocks[2], 0)):
        others = [1.0 + j % 3 for j in range(17) if j != massive]
        ratios = torch.tensor(scales, dtype=torch.float64) / (sum(others) / 16)
        assert blk["massive_ratio"] == pytest.approx([ratios.mean().item()] * 2)
        assert blk["massive_ratio_std"] == pytest.approx([ratios.std(correction=0).item()] * 2)
        kind = "patch" if massive else "time"
        assert blk["massive_tokens"] == [[{"index": massive, "kind": kind, "images": 3}]] * 2
    assert blocks[1]["mode"] == "cog"
    table = massive_table(result)
    assert "patch (1, 1) (100%)" in table.splitlines()[3]  # the mid-block's row
    assert "time (100%)" in table.splitlines()[4]
    # the model's own first block, untouched: the largest token is never below the mean
    assert min(blocks[0]["massive_ratio"]) >= 1.0


def test_captured_values_match_the_block_outputs():
    """The recorder's ratio is the measure of what the block really outputs, computed
    here apart, in float64 by a loop over the tokens."""
    cfg = tiny_cfg(text=True)
    model = tiny_model("uvit", text=True)
    images, contexts = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 12)
    outputs = []
    handle = model.blocks()[0].register_forward_hook(
        lambda m, a, out: outputs.append(out.detach().double()))
    try:
        result = analyze({"m": model}, cfg, images, contexts, timesteps=[500])
    finally:
        handle.remove()
    (hidden,) = outputs
    expected = []
    for image in hidden:
        norms = [float(token.pow(2).sum().sqrt()) for token in image]
        k = max(range(len(norms)), key=norms.__getitem__)
        expected.append((norms[k] / ((sum(norms) - norms[k]) / (len(norms) - 1)), k))
    blk = result["models"]["m"]["blocks"][0]
    mean = sum(r for r, _ in expected) / 2
    assert blk["massive_ratio"] == pytest.approx([mean])
    counted = {t["index"]: t["images"] for t in blk["massive_tokens"][0]}
    assert sum(counted.values()) == 2 and all(k in counted for _, k in expected)


@pytest.mark.slow
def test_every_mode_runs(tmp_path):
    """Softmax, Cog, expressive and sigmoid blocks all report the measure (>= 1, finite),
    and the figure draws it beside the sink share."""
    cfg = tiny_cfg()
    images, _ = load_inputs(cfg, 2)
    modes = ["softmax", "cog", "expressive", "sigmoid"]
    models = {mode: tiny_model(",".join([mode] * 3)) for mode in modes}
    result = json.loads(json.dumps(analyze(models, cfg, images, num_levels=1)))
    check_result(result)
    for mode in modes:
        entry = result["models"][mode]
        assert entry["attention_modes"] == [mode] * 3
        for blk in entry["blocks"]:
            assert 1.0 <= blk["massive_ratio"][0] < float("inf")
            assert sum(t["images"] for t in blk["massive_tokens"][0]) == 2
    table = massive_table(result).splitlines()
    assert len(table) == 2 + 4 * 3 and all(mode in table[2 + 3 * i]
                                           for i, mode in enumerate(modes))
    long_label = "uvic-seed1234-step2100"  # a long label keeps the columns aligned
    renamed = dict(result, models={long_label: result["models"]["cog"]})
    head, row = massive_table(renamed).splitlines()[1:3]
    assert row.startswith(long_label + " ") and head.index("block") == row.index("in_blocks")
    paths = save_figures(result, tmp_path, map_levels=[])
    assert paths["massive_activations"].read_bytes()[:4] == b"\x89PNG"
    assert "heatmap_massive_ratio" in paths
    broken = json.loads(json.dumps(result))
    broken["models"]["cog"]["blocks"][2]["massive_tokens"].append([])
    with pytest.raises(ValueError, match=r"models.cog.blocks\[2\].massive_tokens"):
        check_result(broken)
