"""OV-incoherent skip trigrams: the toy task of attention-head superposition (Jermyn et al.
2023, as Mathwin et al. 2024 generate it), for any attention mode.

A B that follows an unused A must predict its own C, which needs both "an A came before"
and "which B this is": one softmax head cannot map two B's to two C's, so models with fewer
heads than trigrams fail or spread trigrams over heads. The models have one causal,
attention-only layer with one-hot embeddings (docs/gated_attention.md).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from uvic.analysis.superposition.gated import attention_pattern
from uvic_kernels.modes import GATED
from uvic_kernels.reference import lambda_init_at

PROMPT_LENGTH = 11
LEARNT = 0.99  # a trigram counts as learnt at this accuracy


def design_parts(design: str) -> tuple[str, bool]:
    """("cog", True) for "cog+gate": a toy model's attention mode and whether it is gated."""
    return design.removesuffix(GATED), design.endswith(GATED)


def design_cells(designs: list[str], head_counts: list[int]) -> list[tuple[str, int]]:
    """The (design, heads) pairs a toy model can have: differential attention pairs heads,
    so it takes even head counts only."""
    return [(d, h) for d in designs for h in head_counts
            if not (design_parts(d)[0] == "differential" and h % 2)]


@dataclass(frozen=True)
class TrigramData:
    """Prompts (P, length) int64 and ``forced`` (P, length): True where the token is a C
    forced by its B (the positions whose prediction the task is about). ``scored``
    restricts the B positions that the accuracy and "learnt" read (balanced sites)."""

    tokens: Tensor
    forced: Tensor
    num_trigrams: int
    scored: Tensor | None = None  # (P, length - 1): the B input positions scored; None: all

    @property
    def vocab(self) -> int:
        return 2 * self.num_trigrams + 2


def make_prompts(num_trigrams: int, num_prompts: int, seed: int,
                 length: int = PROMPT_LENGTH, bos_recurs: bool = False) -> TrigramData:
    """``num_prompts`` prompts of ``length`` tokens with ``num_trigrams`` skip trigrams;
    ``bos_recurs``: BOS is drawn among the random tokens too (the original generator)."""
    if num_trigrams < 1 or num_prompts < 1 or length < 3:
        raise ValueError(f"need num_trigrams >= 1, num_prompts >= 1 and length >= 3; got "
                         f"{num_trigrams}, {num_prompts}, {length}")
    n = num_trigrams
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(num_prompts, length, dtype=torch.long)
    forced = torch.zeros(num_prompts, length, dtype=torch.bool)
    tokens[:, 0] = 2 * n + 1  # BOS
    pending = torch.zeros(num_prompts, dtype=torch.bool)  # an unused A came before
    nxt = torch.full((num_prompts,), -1, dtype=torch.long)  # a forced next token, or -1
    for pos in range(1, length):
        # uniform over A, B, C; while an A is pending, over B and C only
        draw = torch.randint(0, 2 * n + 1 + bos_recurs, (num_prompts,), generator=g)
        draw_no_a = torch.randint(1, 2 * n + 1 + bos_recurs, (num_prompts,), generator=g)
        token = torch.where(pending, draw_no_a, draw)
        forced[:, pos] = nxt >= 0
        token = torch.where(nxt >= 0, nxt, token)
        tokens[:, pos] = token
        is_b = (token >= 1) & (token <= n)
        fire = pending & is_b
        nxt = torch.where(fire, token + n, torch.full_like(token, -1))
        pending = (pending & ~fire) | (token == 0)
    return TrigramData(tokens, forced, n)


class ToyAttentionModel(nn.Module):
    """One-layer attention-only model with one-hot (un)embeddings, any attention mode.

    ``head_outputs(tokens)`` gives each head's contribution to the logits (P, N, h, vocab);
    ``forward`` gives the logits ``onehot + sum of heads + b_O``. ``mode`` is a kernel mode,
    "differential" (heads paired as in U-ViD), either with "+gate" (an output gate per
    channel on the heads' outputs).
    """

    def __init__(self, vocab: int, num_heads: int, mode: str, head_dim: int = 1,
                 init_std: float = 0.02, output_bias: bool = True,
                 init: str = "normal", layer: int = 1) -> None:
        """``init``: "normal" (weights N(0, init_std), biases 0) or "xavier" (Mathwin et
        al.'s: Xavier-normal weights and Q, K, V biases). ``output_bias=False`` (theirs):
        ``b_O`` is a fixed zero buffer, neither trained nor saved."""
        super().__init__()
        if init not in ("normal", "xavier"):
            raise ValueError(f"init={init!r}: choose 'normal' or 'xavier'")
        mode, gated = design_parts(mode)
        if mode == "differential" and num_heads % 2:
            raise ValueError(f"differential attention pairs heads: num_heads={num_heads} is odd")
        self.vocab, self.num_heads, self.mode, self.head_dim = vocab, num_heads, mode, head_dim
        self.scale = head_dim ** -0.5
        shape, out_shape, bias_shape = ((num_heads, vocab, head_dim),
                                        (num_heads, head_dim, vocab), (num_heads, head_dim))
        if init == "xavier":  # their draws in their order: W_Q, W_K, W_V, W_O, b_Q, b_K, b_V
            values = [nn.init.xavier_normal_(torch.empty(s))
                      for s in (shape, shape, shape, out_shape) + (bias_shape,) * 3]
        else:
            values = ([torch.randn(shape) * init_std for _ in range(3)]
                      + [torch.randn(out_shape) * init_std]
                      + [torch.zeros(bias_shape) for _ in range(3)])
        w_q, w_k, w_v, w_o, b_q, b_k, b_v = (nn.Parameter(v) for v in values)
        self.W_Q, self.W_K, self.W_V, self.b_Q, self.b_K, self.b_V = w_q, w_k, w_v, b_q, b_k, b_v
        self.W_O = w_o
        self.output_bias = output_bias
        if output_bias:
            self.b_O = nn.Parameter(torch.zeros(vocab))
        else:
            self.register_buffer("b_O", torch.zeros(vocab), persistent=False)
        # a design's own weights, drawn after the shared ones (paired across designs)
        self.lambda_init = lambda_init_at(layer)
        if mode == "differential":
            self.lambdas = nn.Parameter(torch.randn(4, head_dim) * 0.1)  # lq1, lk1, lq2, lk2
            self.norm_weight = nn.Parameter(torch.ones(2 * head_dim))
        self.gate = (nn.Parameter(torch.randn(vocab, num_heads * head_dim) * init_std)
                     if gated else None)
        self.gate_bias = nn.Parameter(torch.zeros(num_heads * head_dim)) if gated else None

    def embed(self, tokens: Tensor) -> Tensor:
        """One-hot residual stream (P, N, vocab)."""
        return F.one_hot(tokens, self.vocab).float()

    def attn_heads(self, x: Tensor) -> Tensor:
        """Per-head outputs (P, N, h, vocab) of the attention on the residual stream x."""
        def proj(w: Tensor, b: Tensor) -> Tensor:
            return torch.einsum("bnd,hde->bhne", x, w) + b[None, :, None, :]

        q, k, v = proj(self.W_Q, self.b_Q), proj(self.W_K, self.b_K), proj(self.W_V, self.b_V)
        if self.mode == "differential":
            z = self._differential(q, k, v)
        else:
            z = attention_pattern(q, k, self.mode, self.scale, causal=True) @ v
        if self.gate is not None:  # Y * sigmoid(X W_g + b), per channel of every head
            g = torch.sigmoid(x @ self.gate + self.gate_bias)  # (P, N, h d)
            z = z * g.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        return torch.einsum("bhne,heo->bnho", z, self.W_O)

    def _differential(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """(softmax(S1) - lambda softmax(S2)) V of head pairs (2i, 2i + 1), RMSNorm and
        1 - lambda_init, back in the h heads' layout (P, h, N, d)."""
        lq1, lk1, lq2, lk2 = self.lambdas
        lam = torch.exp(lq1 @ lk1) - torch.exp(lq2 @ lk2) + self.lambda_init
        a = (attention_pattern(q[:, 0::2], k[:, 0::2], "softmax", self.scale, causal=True)
             - lam * attention_pattern(q[:, 1::2], k[:, 1::2], "softmax", self.scale, causal=True))
        z = a @ torch.cat([v[:, 0::2], v[:, 1::2]], dim=-1)  # (P, h/2, N, 2d)
        z = z * torch.rsqrt(z.square().mean(-1, keepdim=True) + 1e-5) * self.norm_weight
        z = z * (1 - self.lambda_init)
        d = self.head_dim
        return torch.stack([z[..., :d], z[..., d:]], dim=2).flatten(1, 2)

    def attn(self, x: Tensor) -> Tensor:
        """The attention block's output (P, N, vocab): what a gated block reproduces."""
        return self.attn_heads(x).sum(dim=2) + self.b_O

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        return x + self.attn(x)


class StackedToyModel(nn.Module):
    """Attention-only layers on the one-hot residual stream, softmax in the first and last
    (as U-ViC keeps them) and ``mode`` between: ``x <- x + layer.attn(x)`` per layer."""

    def __init__(self, vocab: int, num_heads: int, mode: str, depth: int, head_dim: int = 1,
                 init_std: float = 0.02) -> None:
        super().__init__()
        if depth < 3:
            raise ValueError(f"depth={depth}: a stack needs >= 3 layers (softmax first and last)")
        self.vocab, self.num_heads, self.mode, self.head_dim = vocab, num_heads, mode, head_dim
        gate = GATED if design_parts(mode)[1] else ""
        modes = ["softmax" + gate] + [mode] * (depth - 2) + ["softmax" + gate]
        self.layers = nn.ModuleList(
            ToyAttentionModel(vocab, num_heads, m, head_dim, init_std, layer=i + 1)
            for i, m in enumerate(modes))

    def forward(self, tokens: Tensor) -> Tensor:
        x = F.one_hot(tokens, self.vocab).float()
        for layer in self.layers:
            x = x + layer.attn(x)
        return x


def toy_model(vocab: int, num_heads: int, mode: str, head_dim: int = 1,
              init_std: float = 0.02, depth: int = 1) -> nn.Module:
    """One layer of ``mode`` (depth 1), or a stack with softmax first and last."""
    if depth == 1:
        return ToyAttentionModel(vocab, num_heads, mode, head_dim, init_std)
    return StackedToyModel(vocab, num_heads, mode, depth, head_dim, init_std)


def train_toy(model: ToyAttentionModel, data: TrigramData, epochs: int, batch_size: int,
              lr: float = 1e-3, seed: int = 0) -> list[float]:
    """Adam on next-token cross-entropy over every position; returns the epoch losses."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    inputs, targets = data.tokens[:, :-1], data.tokens[:, 1:]
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(inputs), generator=g)
        total = 0.0
        for start in range(0, len(inputs), batch_size):
            idx = order[start:start + batch_size]
            logits = model(inputs[idx])
            loss = F.cross_entropy(logits.reshape(-1, model.vocab), targets[idx].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        losses.append(total / len(inputs))
    return losses


def _b_sites(data: TrigramData, forced: bool) -> tuple[Tensor, Tensor, Tensor]:
    inputs = data.tokens[:, :-1]
    is_b = (inputs >= 1) & (inputs <= data.num_trigrams)
    no_a_yet = torch.cumsum(inputs == 0, dim=1) == 0
    mask = is_b & (data.forced[:, 1:] if forced else no_a_yet)
    if data.scored is not None:
        mask = mask & data.scored
    prompt, pos = torch.nonzero(mask, as_tuple=True)
    return prompt, pos, data.tokens[prompt, pos] - 1


def trigram_sites(data: TrigramData) -> tuple[Tensor, Tensor, Tensor]:
    """(prompt, position, trigram index 0..n-1) of every B whose C follows (input positions)."""
    return _b_sites(data, forced=True)


def free_sites(data: TrigramData) -> tuple[Tensor, Tensor, Tensor]:
    """(prompt, position, trigram index) of every B with no A before it: its C is not
    forced there, so a model that predicts it anyway ignores A."""
    return _b_sites(data, forced=False)


def balanced_prompts(num_trigrams: int, sites_per_trigram: int, seed: int,
                     length: int = PROMPT_LENGTH) -> TrigramData:
    """Prompts whose ``scored`` mask holds exactly ``sites_per_trigram`` forced and as many
    free B positions of every trigram, so that "learnt" means the same at every n."""
    chunk, parts = max(256, 8 * sites_per_trigram * num_trigrams), []
    while True:
        parts.append(make_prompts(num_trigrams, chunk, seed * 7919 + len(parts), length))
        data = TrigramData(torch.cat([d.tokens for d in parts]),
                           torch.cat([d.forced for d in parts]), num_trigrams)
        scored = torch.zeros(data.tokens.shape[0], length - 1, dtype=torch.bool)
        enough = True
        for sites in (trigram_sites(data), free_sites(data)):
            prompt, pos, tri = sites
            for t in range(num_trigrams):
                pick = (tri == t).nonzero().flatten()[:sites_per_trigram]
                enough &= len(pick) == sites_per_trigram
                scored[prompt[pick], pos[pick]] = True
        if enough:
            return TrigramData(data.tokens, data.forced, num_trigrams, scored)


@torch.no_grad()
def trigram_accuracy(model: ToyAttentionModel, data: TrigramData) -> list[float]:
    """Per trigram, the share of its B's at which the model's top prediction is its C."""
    return logit_accuracy(model(data.tokens[:, :-1]), data)


def c_probability(logits: Tensor, data: TrigramData,
                  sites: tuple[Tensor, Tensor, Tensor]) -> list[float]:
    """Per trigram, the model's mean probability of its C at ``sites`` (its B's)."""
    prompt, pos, tri = sites
    prob = logits[prompt, pos].float().softmax(-1)
    p_c = prob.gather(1, (tri + 1 + data.num_trigrams)[:, None])[:, 0].double()
    sums = torch.zeros(data.num_trigrams, dtype=torch.double).index_add_(0, tri, p_c)
    seen = torch.bincount(tri, minlength=data.num_trigrams).double()
    return (sums / seen.clamp_min(1)).tolist()


@torch.no_grad()
def learnt_trigrams(model: nn.Module, prompts: TrigramData) -> list[bool]:
    """Per trigram, whether ``model`` holds it as a skip trigram (one rule everywhere).

    Its C must be the top prediction at >= LEARNT of its forced B's, and at its B's with no
    A before them the C's probability must lie nearer the task's own (1 / (2n + 1)) than
    the model's at forced B's: a rule that ignores A predicts C alike at both and fails.
    """
    logits = model(prompts.tokens[:, :-1])
    chance = 1 / (2 * prompts.num_trigrams + 1)
    accuracy = logit_accuracy(logits, prompts)
    forced = c_probability(logits, prompts, trigram_sites(prompts))
    free = c_probability(logits, prompts, free_sites(prompts))
    return [hit >= LEARNT and p_free < (chance + p_forced) / 2
            for hit, p_forced, p_free in zip(accuracy, forced, free)]


@torch.no_grad()
def logit_accuracy(logits: Tensor, data: TrigramData) -> list[float]:
    """:func:`trigram_accuracy` of logits (P, N, vocab) on ``data``'s inputs, whatever
    computed them (a model, or a gated block in a model's place)."""
    prompt, pos, tri = trigram_sites(data)
    right = (logits[prompt, pos].argmax(-1) == tri + 1 + data.num_trigrams).double()
    hits = torch.zeros(data.num_trigrams, dtype=torch.double).index_add_(0, tri, right)
    seen = torch.bincount(tri, minlength=data.num_trigrams).double()
    return (hits / seen.clamp_min(1)).tolist()


@torch.no_grad()
def head_encodings(heads: Tensor, base: Tensor, data: TrigramData,
                   min_share: float = LEARNT) -> dict:
    """Which heads encode each trigram on their own (the paper's test of superposition).

    ``heads``: per-head outputs (P, N, h, vocab) on ``data``'s inputs, ``base`` (P, N, vocab)
    the rest of the logits (embedding and output bias). Head h encodes trigram t when, at
    t's B sites, keeping h and removing any combination of the other heads still leaves C
    as the top logit (on ``min_share`` of the sites). Returns ``single``: per trigram the
    heads that encode it alone; ``shared``: trigrams the whole block gets right (on
    ``min_share`` of their sites) that no head encodes alone: superposition; ``bias``:
    trigrams the rest of the logits gets right with every head removed (no head is
    credited with those).
    """
    num_heads = heads.shape[2]
    prompt, pos, tri = trigram_sites(data)
    outs, rest = heads[prompt, pos], base[prompt, pos]  # (S, h, vocab), (S, vocab)
    single, shared, bias = [], [], []
    for t in range(data.num_trigrams):
        sel, sel_rest = outs[tri == t], rest[tri == t]
        target = t + 1 + data.num_trigrams
        encoders = []
        if len(sel) and float((sel_rest.argmax(-1) == target).double().mean()) >= min_share:
            bias.append(t)
            single.append(encoders)
            continue
        for h in range(num_heads):
            others = [o for o in range(num_heads) if o != h]
            drops = [set(c) for r in range(len(others) + 1)
                     for c in itertools.combinations(others, r)]
            keep = torch.tensor([[float(o not in drop) for o in range(num_heads)]
                                 for drop in drops])  # (subsets, h)
            logits = torch.einsum("shv,ch->scv", sel, keep) + sel_rest[:, None]
            ok = (logits.argmax(-1) == target).all(dim=1).double().mean()
            if len(sel) and float(ok) >= min_share:
                encoders.append(h)
        single.append(encoders)
        whole = (sel.sum(dim=1) + sel_rest).argmax(-1) == target
        if not encoders and len(sel) and float(whole.double().mean()) >= min_share:
            shared.append(t)
    return {"single": single, "shared": shared, "bias": bias}


@torch.no_grad()
def trigram_gates(gate: Tensor, data: TrigramData, threshold: float) -> list[float]:
    """Per trigram, the mean number of heads whose gate from B to its A exceeds threshold.

    ``gate``: (P, h, N, N) gates of a gated block on ``data``'s inputs.
    """
    prompt, pos, tri = trigram_sites(data)
    tokens = data.tokens[:, :-1]
    # the A of a B is the last A before it
    is_a = (tokens == 0).long() * torch.arange(tokens.shape[1])
    last_a = torch.cummax(is_a, dim=1).values[prompt, pos]
    opened = (gate[prompt, :, pos, last_a] > threshold).sum(dim=1).double()
    sums = torch.zeros(data.num_trigrams, dtype=torch.double).index_add_(0, tri, opened)
    seen = torch.bincount(tri, minlength=data.num_trigrams).double()
    return (sums / seen.clamp_min(1)).tolist()


def hand_built_model(strength: float = 10.0) -> ToyAttentionModel:
    """A 2-head softmax model that holds 3 trigrams by superposition, weights set by hand.

    Head 0 attends from B1 and B3 to A, head 1 from B2 and B3 (query +s, A's key +1);
    every other query attends to BOS (query -s, BOS's key -1), whose value is 0, so the
    block writes nothing but at those B's. A's value is 1; head 0
    writes C1 + 0.6 C3, head 1 writes C2 + 0.6 C3 (and the output bias is -1 on the B's).
    So B1 and B2 are each one head's, and B3 gets C3 only from both heads together
    (1.2 over 1): no single head encodes it. Head width 1, vocabulary 8 (A, B1..B3, C1..C3, BOS).
    """
    model = ToyAttentionModel(vocab=8, num_heads=2, mode="softmax")
    a, bos, b1, b2, b3, c1, c2, c3 = 0, 7, 1, 2, 3, 4, 5, 6
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for head, chosen in ((0, (b1, b3)), (1, (b2, b3))):
            model.W_Q[head, :, 0] = -strength  # every other query looks at BOS
            for b in chosen:
                model.W_Q[head, b, 0] = strength
            model.W_K[head, a, 0], model.W_K[head, bos, 0] = 1.0, -1.0
            model.W_V[head, a, 0] = 1.0
            model.W_O[head, 0, c1 if head == 0 else c2] = 1.0
            model.W_O[head, 0, c3] = 0.6
        model.b_O[b1:b3 + 1] = -1.0  # the embedding's B does not outvote its C
    return model
