"""The control: Mathwin et al.'s published models (2024, "Gated Attention Blocks") run through
uvic (`uvic-gated-attention control`; docs/gated_attention.md, "The control").

`load_original` and `load_gated` read the paper's safetensors files (uvic's conventions,
without output bias) into `ToyAttentionModel` and `GatedAttentionBlock`; `control` runs
uvic's head test and the paper's (`paper_check`, on `paper_prompts`) on the three published
settings and compares both with the paper's own report (`PAPER_EXPECTED`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from uvic.analysis.superposition.gated import GatedAttentionBlock
from uvic.analysis.superposition.skip_trigrams import (
    LEARNT,
    PROMPT_LENGTH,
    ToyAttentionModel,
    TrigramData,
    head_encodings,
    logit_accuracy,
    make_prompts,
    trigram_sites,
)

# the paper's settings: name -> (heads of the original, trigrams); the gated blocks have
# twice the heads (its expansion factor 2)
PAPER_SETTINGS = {"2x3": (2, 3), "3x4": (3, 4), "4x5": (4, 5)}

# What the paper's own check (its code, its prompts: 100,000 prompts of seed 1 for
# "learnt" and the summed-output test, 1,000 of seed 42 for the head test) reports on its
# published files, in uvic's terms: ``single`` per trigram t (B token t + 1) the heads
# that encode it alone, ``shared`` the learnt trigrams no head holds alone whose mean
# summed head output has C on top ("Distributed Repr"), ``not_learnt``.
PAPER_EXPECTED = {
    "2x3": {"original": {"single": [[1], [], [0]], "shared": [1], "not_learnt": []},
            "gated": {"single": [[1], [0], [3]], "shared": [], "not_learnt": []}},
    "3x4": {"original": {"single": [[], [0], [], [2]], "shared": [0, 2], "not_learnt": []},
            "gated": {"single": [[2], [1], [0], [4]], "shared": [], "not_learnt": []}},
    "4x5": {"original": {"single": [[1], [2], [0], [], [3]], "shared": [3],
                         "not_learnt": []},
            "gated": {"single": [[5], [3], [7], [0], [1]], "shared": [], "not_learnt": []}},
}

_PROJECTIONS = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V")
_GATES = ("W_gate_Q", "W_gate_K", "b_gate_Q", "b_gate_K")


def paper_files(setting: str) -> tuple[str, str]:
    """File names of a setting's original and gated block in the paper's saved_models."""
    heads, trigrams = PAPER_SETTINGS[setting]
    return f"toy_model_{heads}H_{trigrams}ST.st", f"gated_block_{2 * heads}H_{trigrams}ST.st"


def _read(path: Path, required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
    """The file's tensors by name, without a common ``attn.`` prefix; every required key
    present and no unknown one."""
    try:
        tensors = load_file(str(path))
    except SafetensorError as err:  # an LFS pointer or a truncated download reads so
        raise ValueError(f"{path}: not a safetensors file ({err})") from None
    if tensors and all(k.startswith("attn.") for k in tensors):
        tensors = {k[len("attn."):]: v for k, v in tensors.items()}
    missing = [k for k in required if k not in tensors]
    unknown = sorted(set(tensors) - set(required) - set(optional))
    if missing or unknown:
        raise ValueError(f"{path}: not the paper's layout (missing {missing}, unknown "
                         f"{unknown})")
    return {k: v.float() for k, v in tensors.items()}


def _check_shapes(path: Path, t: dict) -> tuple[int, int, int]:
    """(heads, d_model, d_head) of the (h, d_model, d_head) layout, every shape checked."""
    h, d, dh = t["W_Q"].shape
    want = {"W_Q": (h, d, dh), "W_K": (h, d, dh), "W_V": (h, d, dh), "W_O": (h, dh, d),
            "b_Q": (h, dh), "b_K": (h, dh), "b_V": (h, dh), "b_O": (d,)}
    if "W_gate_Q" in t:
        dg = t["W_gate_Q"].shape[-1]
        want.update({"W_gate_Q": (h, d, dg), "W_gate_K": (h, d, dg), "b_gate_Q": (h, dg),
                     "b_gate_K": (h, dg)})
    for name in t:
        if tuple(t[name].shape) != want[name]:
            raise ValueError(f"{path}: {name} has shape {tuple(t[name].shape)}, expected "
                             f"{want[name]}")
    if d < 4 or d % 2:
        raise ValueError(f"{path}: d_model {d} is not a skip-trigram vocabulary (2n + 2)")
    return h, d, dh


def _copy(module: torch.nn.Module, tensors: dict) -> None:
    with torch.no_grad():
        for name, value in tensors.items():
            getattr(module, name).copy_(value)


def load_original(path: str | Path) -> ToyAttentionModel:
    """The paper's one-layer original (``toy_model_*.st``) as a softmax ToyAttentionModel,
    without output bias unless the file has one (``attn.IGNORE``, their -1e5 mask fill, is
    not a weight: uvic masks exactly)."""
    path = Path(path)
    t = _read(path, _PROJECTIONS, ("b_O", "IGNORE"))
    t.pop("IGNORE", None)
    heads, d, dh = _check_shapes(path, t)
    model = ToyAttentionModel(d, heads, "softmax", head_dim=dh, output_bias="b_O" in t)
    _copy(model, t)
    return model.eval()


def load_gated(path: str | Path) -> GatedAttentionBlock:
    """The paper's gated block (``gated_block_*.st``) as a causal softmax
    GatedAttentionBlock, without output bias unless the file has one."""
    path = Path(path)
    t = _read(path, _PROJECTIONS + _GATES, ("b_O",))
    heads, d, dh = _check_shapes(path, t)
    block = GatedAttentionBlock(d, d, heads, dh, mode="softmax", causal=True,
                                d_gate=t["W_gate_Q"].shape[-1], output_bias="b_O" in t)
    _copy(block, t)
    return block.eval()


def paper_prompts(num_trigrams: int, num_prompts: int, seed: int,
                  length: int = PROMPT_LENGTH) -> TrigramData:
    """Prompts of ``length`` tokens drawn as the paper draws them, plus one token.

    As :func:`~uvic.analysis.superposition.skip_trigrams.make_prompts`, but each token is
    uniform over A, B, C and BOS (B, C, BOS while an A waits): BOS can recur. One more token
    is drawn so that a B at the prompt's last position has its C (the paper counts that
    trigram); the inputs ``tokens[:, :-1]`` are the paper's prompts.
    """
    return make_prompts(num_trigrams, num_prompts, seed, length + 1, bos_recurs=True)


def one_trigram(data: TrigramData) -> Tensor:
    """(P,) True for the prompts with exactly one trigram among their inputs' B's."""
    return data.forced[:, 1:].sum(dim=1) == 1


@torch.no_grad()
def paper_head_test(heads: Tensor, data: TrigramData,
                    min_share: float = LEARNT) -> list[list[int]]:
    """Per trigram, the heads that encode it alone by the paper's test.

    ``heads``: per-head outputs (P, N, h, vocab) on ``data``'s inputs. At the B of each
    prompt with exactly one trigram, head h passes when the summed outputs of the heads
    kept (no embedding, no bias) have C on top for every non-empty set of other heads
    removed; h encodes the trigram when it passes at more than ``min_share`` of them.
    """
    num_heads = heads.shape[2]
    if num_heads < 2:
        raise ValueError("the paper's head test removes other heads: it needs >= 2 heads")
    prompt, pos, tri = trigram_sites(data)
    alone = one_trigram(data)[prompt]
    outs, tri = heads[prompt[alone], pos[alone]], tri[alone]  # (S, h, vocab)
    encoders = []
    for t in range(data.num_trigrams):
        sel, target = outs[tri == t], t + 1 + data.num_trigrams
        found = []
        for h in range(num_heads):
            others = [o for o in range(num_heads) if o != h]
            keep = torch.tensor([[float(o not in drop) for o in range(num_heads)]
                                 for r in range(1, len(others) + 1)
                                 for drop in itertools.combinations(others, r)])
            right = torch.einsum("shv,ch->scv", sel, keep).argmax(-1) == target
            if len(sel) and float(right.all(dim=1).double().mean()) > min_share:
                found.append(h)
        encoders.append(found)
    return encoders


@torch.no_grad()
def paper_check(heads: Tensor, logits: Tensor, data: TrigramData,
                encoders: list[list[int]] | None = None, length: int = PROMPT_LENGTH,
                min_share: float = LEARNT) -> dict:
    """The paper's whole check of a model: which heads hold each trigram, JSON-ready.

    A trigram is learnt when the model's ``logits`` have C on top at more than
    ``min_share`` of its B's whose C lies inside a prompt of ``length``. Learnt trigrams
    get their heads from ``encoders`` (default :func:`paper_head_test` on ``data``);
    ``shared``: learnt ones no head holds alone whose summed head output, averaged over
    their B's, has C on top; ``not_learnt``: the rest of the unlearnt.
    """
    if encoders is None:
        encoders = paper_head_test(heads, data, min_share)
    prompt, pos, tri = trigram_sites(data)
    inside = pos + 1 < length
    prompt, pos, tri = prompt[inside], pos[inside], tri[inside]
    n = data.num_trigrams
    right = (logits[prompt, pos].argmax(-1) == tri + 1 + n).double()
    summed = heads[prompt, pos].sum(dim=1).double()  # (S, vocab)
    single, shared, not_learnt = [], [], []
    for t in range(n):
        sel = tri == t
        if not sel.any() or not float(right[sel].mean()) > min_share:
            single.append([])
            not_learnt.append(t)
            continue
        single.append(list(encoders[t]))
        if not encoders[t] and int(summed[sel].mean(dim=0).argmax()) == t + 1 + n:
            shared.append(t)
    return {"single": single, "shared": shared, "not_learnt": not_learnt}


def _outputs(model: ToyAttentionModel | GatedAttentionBlock,
             data: TrigramData) -> tuple[Tensor, Tensor, Tensor]:
    """Per-head outputs, the rest of the logits (embedding and output bias) and the
    logits of the one-layer model on ``data``'s inputs (a gated block in the attention's
    place)."""
    x = torch.nn.functional.one_hot(data.tokens[:, :-1], 2 * data.num_trigrams + 2).float()
    with torch.no_grad():
        heads = (model.attn_heads(x) if isinstance(model, ToyAttentionModel)
                 else model.head_outputs(x))
        base = x + model.b_O
        return heads, base, base + heads.sum(dim=2)


def _matches(found: dict, expected: dict) -> bool:
    return found["single"] == expected["single"] and found["shared"] == expected["shared"]


def control(models_dir: str | Path, num_prompts: int = 10_000, seed: int = 0,
            say: Callable[[str], None] = print) -> dict:
    """Both head tests on the paper's three published settings, JSON-ready.

    Per setting and model (original, gated): the paper's expected result
    (:data:`PAPER_EXPECTED`), uvic's test (embedding and output bias in the logits, all
    prompts), uvic's test on the heads alone over one-trigram prompts, and the paper's
    check, on uvic's prompts and on the paper's (``num_prompts`` each, ``seed``).
    """
    models_dir = Path(models_dir)
    result = {"models_dir": str(models_dir), "num_prompts": num_prompts, "seed": seed,
              "trigram_numbering": "0-based: trigram t is B token t + 1", "settings": {}}
    for setting, (num_heads, trigrams) in PAPER_SETTINGS.items():
        names = paper_files(setting)
        models = {"original": load_original(models_dir / names[0]),
                  "gated": load_gated(models_dir / names[1])}
        for kind, want in (("original", num_heads), ("gated", 2 * num_heads)):
            model = models[kind]
            if model.num_heads != want or model.W_Q.shape[1] != 2 * trigrams + 2:
                raise ValueError(f"{models_dir / names[kind == 'gated']}: {model.num_heads} "
                                 f"heads over {model.W_Q.shape[1]} tokens, expected {want} "
                                 f"over {2 * trigrams + 2} ({setting})")
        prompts = {"uvic": make_prompts(trigrams, num_prompts, seed),
                   "paper": paper_prompts(trigrams, num_prompts, seed)}
        entry = {"heads": num_heads, "trigrams": trigrams, "files": list(names)}
        for kind, model in models.items():
            expected = PAPER_EXPECTED[setting][kind]
            row: dict = {"expected": expected}
            for source, data in prompts.items():
                heads, base, logits = _outputs(model, data)
                alone = one_trigram(data)
                single = TrigramData(data.tokens[alone], data.forced[alone], trigrams)
                row[f"{source}_prompts"] = {
                    "accuracy": logit_accuracy(logits, data),
                    "uvic_test": head_encodings(heads, base, data),
                    "uvic_test_heads_only": head_encodings(
                        heads[alone], torch.zeros_like(base[alone]), single),
                    "paper_test": paper_check(heads, logits, data)}
            for source in prompts:
                found = row[f"{source}_prompts"]
                found["uvic_matches"] = _matches(found["uvic_test"], expected)
                found["paper_matches"] = _matches(found["paper_test"], expected)
            entry[kind] = row
            say(f"{setting} {kind}: expected {describe(expected)}; uvic's test "
                f"{describe(row['uvic_prompts']['uvic_test'])}; paper's test "
                f"{describe(row['uvic_prompts']['paper_test'])} (paper's prompts: "
                f"{describe(row['paper_prompts']['paper_test'])})")
        result["settings"][setting] = entry
    return result


def describe(enc: dict) -> str:
    """One trigram after another: its heads (``h1``, ``h0+h2``), ``shared``, ``bias``
    (the embedding and output bias alone), ``not learnt`` or ``-`` (lost)."""
    parts = []
    for t, found in enumerate(enc["single"]):
        if found:
            what = "+".join(f"h{h}" for h in found)
        elif t in enc.get("shared", []):
            what = "shared"
        elif t in enc.get("bias", []):
            what = "bias"
        elif t in enc.get("not_learnt", []):
            what = "not learnt"
        else:
            what = "-"
        parts.append(f"t{t} {what}")
    return ", ".join(parts)


def control_markdown(result: dict) -> str:
    """The control as a markdown table: per setting and model, the paper's expected
    encodings, uvic's test and the paper's test (uvic's prompts, then the paper's)."""
    lines = [f"Prompts: {result['num_prompts']} per setting and kind, seed {result['seed']}; "
             "trigram t is B token t + 1; `hK`: head K encodes it alone, `shared`: only "
             "heads together, `bias`: the embedding and output bias alone, `-`: lost.", "",
             "| setting | model | paper's code (expected) | uvic's test | match | "
             "paper's test | match | paper's test, paper's prompts | match |",
             "|---|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no"}
    for setting, entry in result["settings"].items():
        for kind in ("original", "gated"):
            row = entry[kind]
            ours, theirs = row["uvic_prompts"], row["paper_prompts"]
            lines.append(
                f"| {setting} | {kind} | {describe(row['expected'])} | "
                f"{describe(ours['uvic_test'])} | {yes[ours['uvic_matches']]} | "
                f"{describe(ours['paper_test'])} | {yes[ours['paper_matches']]} | "
                f"{describe(theirs['paper_test'])} | {yes[theirs['paper_matches']]} |")
    return "\n".join(lines) + "\n"
