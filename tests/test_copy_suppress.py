"""Copy-and-suppress: prompts and targets, a hand-built Cog head that solves it by the
sign of q.k where softmax with the same weights cannot, and the command end to end."""

import json

import pytest
import torch

from uvic.analysis.superposition import copy_suppress as CS
from uvic.analysis.superposition.capacity import Grid, ToyRecipe
from uvic.analysis.superposition.skip_trigrams import ToyAttentionModel
from uvic.cli.gated_attention import main

TASK = CS.CopySuppressTask(group=3, fillers=2, slots=5)


def test_prompts_hold_one_token_of_each_group_and_a_query():
    tokens = TASK.prompts(500, seed=0)
    assert tokens.shape == (500, 7) and (tokens[:, 0] == TASK.bos).all()
    slots = tokens[:, 1:-1]
    assert ((slots < 3).sum(1) == 1).all() and (((slots >= 3) & (slots < 6)).sum(1) == 1).all()
    assert set(tokens[:, -1].tolist()) == {TASK.q1, TASK.q2}
    up, down = TASK.raised_lowered(tokens)
    first = tokens[:, -1] == TASK.q1
    assert ((up < 3) == first).all() and ((down >= 3) == first).all()
    target = TASK.target(tokens)
    torch.testing.assert_close(target.sum(1), torch.ones(500, dtype=target.dtype))
    assert (target[torch.arange(500), up] == 0.5).all()
    assert (target[torch.arange(500), down] == 0).all()


def sign_head(mode: str) -> ToyAttentionModel:
    """One head of width 7: dimension 0 carries the query's sign (+10 for Q1, -10 for Q2)
    against the groups' keys (+1 group 1, -1 group 2); dimensions 1-6 copy a group token's
    identity to its own logit (x 10)."""
    model = ToyAttentionModel(TASK.vocab, 1, mode, head_dim=7)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.W_Q[0, TASK.q1, 0], model.W_Q[0, TASK.q2, 0] = 10.0, -10.0
        model.W_K[0, :3, 0], model.W_K[0, 3:6, 0] = 1.0, -1.0
        for t in range(6):
            model.W_V[0, t, 1 + t], model.W_O[0, 1 + t, t] = 1.0, 10.0
    return model


def test_one_cog_head_raises_and_lowers_by_sign_softmax_cannot():
    tokens = TASK.prompts(1000, seed=1)
    assert TASK.solved_share(sign_head("cog"), tokens) == 1.0
    # softmax looks at the raised token only: the lowered one is never pushed down
    assert TASK.solved_share(sign_head("softmax"), tokens) < 0.5


def test_bad_task_sizes_are_refused():
    with pytest.raises(ValueError, match="need group >= 2"):
        CS.CopySuppressTask(group=1)


def test_experiment_resumes_and_reports_every_cell(tmp_path):
    recipe = ToyRecipe(head_dim=6, max_steps=20, check_every=10)
    grid = Grid(lrs=(1e-1,), init_stds=(0.02,), seeds=1)
    table = CS.copy_suppress_experiment(tmp_path, ["softmax", "cog"], [1], [0, 1], recipe,
                                        grid, TASK, say=lambda _: None)
    assert [(c["mode"], c["of"]) for c in table["cells"]] == [("softmax", 2), ("cog", 2)]
    lines = (tmp_path / "models.jsonl").read_text().splitlines()
    assert len(lines) == 6
    again = CS.copy_suppress_experiment(tmp_path, ["softmax", "cog"], [1], [0, 1], recipe,
                                        grid, TASK, say=lambda _: None)
    assert again == table and len((tmp_path / "models.jsonl").read_text().splitlines()) == 6
    assert CS.markdown(table).splitlines()[0] == "| mode | 1 head |"


@pytest.mark.slow
def test_cli_copy_suppress(tmp_path, capsys):
    out = tmp_path / "cs"
    assert main(["copy-suppress", "--modes", "cog", "--heads", "1", "--seeds", "1",
                 "--group", "2", "--lr", "0.1", "--init-std", "0.02", "--max-steps", "100",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    table = json.loads((out / "copy_suppress.json").read_text())
    assert table["base"]["head_dim"] == 4 and table["task"]["group"] == 2
    assert (out / "copy_suppress.md").is_file()
    with pytest.raises(SystemExit):
        main(["copy-suppress", "--group", "1", "--out", str(out)])
    assert "--group: '1' must be >= 2" in capsys.readouterr().err


def test_documented_table_is_what_the_code_renders_from_the_recorded_run():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs/gated_attention.md").read_text()
    for record in ("gated_copy_suppress.json", "gated_copy_suppress_controls.json"):
        table = json.loads((root / "docs" / record).read_text())
        for line in CS.markdown(table).splitlines():
            assert line in docs, line
