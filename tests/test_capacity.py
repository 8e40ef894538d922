"""The skip-trigram capacity experiment: the "learnt" rule on hand-built models in closed
form, balanced sites, training to a plateau, the tuning grid and resuming from the ledger."""

import json

import pytest
import torch

from uvic.analysis.superposition import capacity as C
from uvic.analysis.superposition import skip_trigrams as S


def _zeroed(vocab: int, mode: str) -> S.ToyAttentionModel:
    model = S.ToyAttentionModel(vocab, 1, mode)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def a_blind_model() -> S.ToyAttentionModel:
    """One trigram (A 0, B 1, C 2, BOS 3): the head looks from B at B and writes C, A or no A."""
    model = _zeroed(4, "softmax")
    with torch.no_grad():
        model.W_Q[0, 1, 0], model.W_K[0, 1, 0] = 10.0, 1.0
        model.W_V[0, 1, 0], model.W_O[0, 0, 2] = 1.0, 10.0
    return model


def sign_model(mode: str) -> S.ToyAttentionModel:
    """Two trigrams (A 0, B 1-2, C 3-4, BOS 5) in one head of width 1: B1's query is +10 and
    B2's -10 against A's key 1; A's value 1 writes +C1 - C2. Under Cog the sign of q.k
    picks C1 or C2; under softmax B2 looks away from A."""
    model = _zeroed(6, mode)
    with torch.no_grad():
        model.W_Q[0, 1, 0], model.W_Q[0, 2, 0], model.W_K[0, 0, 0] = 10.0, -10.0, 1.0
        model.W_V[0, 0, 0], model.W_O[0, 0, 3], model.W_O[0, 0, 4] = 1.0, 10.0, -10.0
    return model


def test_a_blind_rule_is_not_learnt_though_it_is_always_right_at_forced_sites():
    prompts = S.balanced_prompts(1, 200, seed=0)
    model = a_blind_model()
    assert S.trigram_accuracy(model, prompts) == [1.0]
    assert S.learnt_trigrams(model, prompts) == [False]


def test_one_cog_head_of_width_one_holds_two_trigrams_by_sign_softmax_one():
    prompts = S.balanced_prompts(2, 200, seed=0)
    assert S.learnt_trigrams(sign_model("cog"), prompts) == [True, True]
    assert S.trigram_accuracy(sign_model("cog"), prompts) == [1.0, 1.0]
    assert S.learnt_trigrams(sign_model("softmax"), prompts) == [True, False]


def test_balanced_prompts_score_the_same_sites_per_trigram_at_every_n():
    for n in (1, 4, 9):
        data = S.balanced_prompts(n, 30, seed=n)
        for sites in (S.trigram_sites(data), S.free_sites(data)):
            assert torch.bincount(sites[2], minlength=n).tolist() == [30] * n
        prompt, pos, _ = S.free_sites(data)
        before = [data.tokens[p, :q + 1].tolist() for p, q in zip(prompt, pos)]
        assert all(0 not in b for b in before)  # no A before a free B
        prompt, pos, tri = S.trigram_sites(data)
        assert (data.tokens[prompt, pos + 1] == tri + 1 + n).all()  # its C follows


def test_stack_keeps_softmax_first_and_last():
    model = S.toy_model(6, 2, "cog", depth=4)
    assert [layer.mode for layer in model.layers] == ["softmax", "cog", "cog", "softmax"]
    assert model(torch.zeros(3, 5, dtype=torch.long)).shape == (3, 5, 6)
    assert isinstance(S.toy_model(6, 2, "cog"), S.ToyAttentionModel)


@pytest.mark.parametrize("field,value,words", [
    ("lr", 0.0, "lr=0.0: must be > 0"), ("depth", 2, "depth=2: use 1, or >= 3"),
    ("head_dim", 0, "head_dim=0: must be >= 1"), ("sites", 0, "sites=0")])
def test_recipe_refuses_settings_in_one_line(field, value, words):
    with pytest.raises(ValueError, match=words):
        C.ToyRecipe(**{field: value}).check()


@pytest.mark.slow
def test_training_stops_at_a_plateau_and_learns_one_trigram():
    """One softmax head learns one trigram within the bound and stops before it."""
    recipe = C.ToyRecipe(lr=3e-2, max_steps=3000, check_every=50, patience=3, sites=100)
    record = C.run_model("softmax", 1, 1, 0, recipe)
    assert record["converged"] and record["steps"] < 3000
    assert record["learnt"] == [True] and record["all_learnt"]


def test_summary_counts_every_n_and_capacity_is_the_largest_n_learnt():
    """A seed that fails at 2 and learns 3 has capacity 3 (no stop at the first failure)."""
    def rec(ok):
        return {"all_learnt": ok, "converged": True, "learnt": [ok]}

    runs = [[rec(True), rec(False), rec(True)], [rec(True), rec(True), rec(False)]]
    cell = C.summarise("cog", 1, [0, 1], 3, runs)
    assert cell["capacity"] == [3, 2] and cell["hit_max"]
    assert [s["learnt"] for s in cell["success"]] == [2, 1, 1]
    low, high = cell["success"][1]["interval_95"]
    assert low == pytest.approx(0.0126, abs=1e-4) and high == pytest.approx(0.9874, abs=1e-4)


def test_experiment_tunes_alike_and_resumes_without_redoing_models(tmp_path, monkeypatch):
    """Each mode's recipe is chosen from the same grid on tuning seeds; a second run with
    the ledger in place trains nothing; a cut last line is retrained."""
    calls = []

    def fake(mode, heads, n, seed, recipe):
        calls.append((mode, heads, n, seed, recipe.lr))
        ok = (mode == "cog") == (recipe.lr > 0.05) and n <= heads + (seed < C.TUNING_SEED)
        return {"steps": 1, "converged": True, "loss": 1.0 / recipe.lr, "learnt": [ok] * n,
                "all_learnt": ok, "accuracy": [1.0] * n, "seconds": 0.0}

    monkeypatch.setattr(C, "run_model", fake)
    grid = C.Grid(lrs=(1e-2, 1e-1), init_stds=(0.02,), seeds=1)
    args = (tmp_path, ["softmax", "cog"], [1], [0, 1], 3, C.ToyRecipe(), grid)
    table = C.capacity_experiment(*args, say=lambda _: None)
    assert {t["mode"]: t["chosen"] for t in table["tuning"]} == {
        "softmax": "lr=0.01,init=0.02", "cog": "lr=0.1,init=0.02"}
    assert all(s < C.TUNING_SEED for *_, s, _ in calls[-12:])  # reported after tuning
    assert [c["capacity"] for c in table["cells"]] == [[2, 2], [2, 2]]
    assert len(calls) == 2 * 2 * 3 + 2 * 2 * 3
    ledger = tmp_path / "models.jsonl"
    lines = ledger.read_text().splitlines()
    ledger.write_text("\n".join([*lines[:-1], lines[-1][:10]]) + "\n")
    calls.clear()
    again = C.capacity_experiment(*args, say=lambda _: None)
    assert len(calls) == 1 and again["cells"] == table["cells"]
    assert json.loads(ledger.read_text().splitlines()[0])["key"].startswith("tune:")


def test_differential_runs_at_even_head_counts_only_and_the_tables_say_so(tmp_path,
                                                                          monkeypatch, capsys):
    """Differential attention pairs heads: with --heads 1,2 its 1-head cell is not trained
    and the tables show it as absent (—), while its 2-head cell is paired with softmax."""
    from uvic.cli.gated_attention import main

    calls = []

    def fake(mode, heads, n, seed, recipe):
        calls.append((mode, heads))
        ok = n <= heads + (mode == "differential")
        return {"steps": 1, "converged": True, "loss": 1.0, "learnt": [ok] * n,
                "all_learnt": ok, "accuracy": [1.0] * n, "seconds": 0.0}

    monkeypatch.setattr(C, "run_model", fake)
    out = tmp_path / "cap"
    assert main(["capacity", "--modes", "softmax,differential", "--heads", "1,2", "--seeds",
                 "2", "--max-trigrams", "3", "--lr", "0.01", "--init-std", "0.02",
                 "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "skipped (differential attention pairs heads): differential with 1 head" in said
    assert ("differential", 1) not in calls and ("differential", 2) in calls
    table = json.loads((out / "capacity.json").read_text())
    assert [(c["mode"], c["heads"]) for c in table["cells"]] == [
        ("softmax", 1), ("softmax", 2), ("differential", 2)]
    text = (out / "capacity.md").read_text()
    assert "| differential | — | 3.00 ± 0.00 [3, 3+] |" in text
    assert "| differential | 2 | lr=0.01,init=0.02 | 2/2 | 2/2 | 2/2 |" in text
    with pytest.raises(ValueError, match="--heads 1: differential attention pairs heads"):
        from uvic.cli.gated_attention import _cells
        _cells(["differential"], [1])


def test_paired_rows_state_the_mde_and_read_equivalence_only_from_tost():
    """Differences (1, 0, 2, 0): mean +0.75, t half-width 3.182 * 0.957 / 2 = 1.52,
    inconclusive with its MDE, sign test 2 of 2 non-ties: p 0.5; differences of 0 within a
    margin of 1 read as equivalent; a mode at the trigram limit is a lower bound that
    supports no reading; every seed one higher is "more", its sign test p 2 / 2^4."""
    def cell(mode, caps, hit_max=False):
        return {"mode": mode, "heads": 2, "seeds": [0, 1, 2, 3], "capacity": caps,
                "hit_max": hit_max}

    cells = [cell("softmax", [1, 2, 3, 3]), cell("cog", [2, 2, 5, 3]),
             cell("expressive", [1, 2, 3, 3]), cell("sigmoid", [8, 8, 8, 8], hit_max=True),
             cell("other", [2, 3, 4, 4])]
    rows = C.paired_rows(cells, margin=1.0)
    assert rows[0].startswith("| capacity: mode - softmax | heads | mean ± 95% t | t p |")
    assert rows[2].startswith("| cog | 2 | +0.75 ± 1.52 | 0.22 | 0.5 | ")
    assert "inconclusive: MDE" in rows[2]
    assert rows[3].startswith("| expressive | 2 | +0.00 ± 0.00 |") and "equivalent" in rows[3]
    assert rows[4].startswith("| sigmoid | 2 | >= +5.75") and "trigram limit" in rows[4]
    assert rows[5].startswith("| other | 2 | +1.00 ± 0.00 | 0 | 0.12 |")
    assert rows[5].endswith("| more |")
    assert C.paired_rows(cells[:1], margin=1.0) == []
    assert C.sign_test_p([1, 2], [1, 2]) == 1.0


def test_documented_tables_are_what_the_code_renders_from_the_recorded_run():
    """The README's capacity tables and the docs' full ones come from the recorded run
    (docs/gated_capacity.json) through the same functions, line for line."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    table = json.loads((root / "docs/gated_capacity.json").read_text())
    readme = (root / "README.md").read_text()
    for line in C.summary_markdown(table).splitlines():
        assert line in readme, line
    docs = (root / "docs/gated_attention.md").read_text()
    for line in C.capacity_markdown(table).splitlines():
        assert line in docs, line
    controls = json.loads((root / "docs/gated_capacity_controls.json").read_text())
    lines = C.capacity_markdown(controls).splitlines()
    for key in C.BOUND:
        lines += [row for row in C.paired_rows(controls["cells"], controls["margin"],
                                               base="cog", key=key)
                  if row.startswith(("| differential ", "| cog+gate "))]
    assert "| differential | — | 1.80 ± 1.62 [1, 4] |" in lines
    for line in lines:
        assert line in docs, line


def test_documented_sensitivity_table_is_what_the_code_renders():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    table = json.loads((root / "docs/gated_sensitivity.json").read_text())
    docs = (root / "docs/gated_attention.md").read_text()
    for line in C.sensitivity_markdown(table).splitlines():
        assert line in docs, line
