"""Cog / expressive / sigmoid / softmax attention processors for diffusers models.

The processors must equal diffusers' ``AttnProcessor2_0`` apart from the attention op.
Two oracles: ``AttnProcessor2_0`` itself (for softmax through our kernel), and, for
every mode, ``AttnProcessor2_0`` run in float64 with its ``scaled_dot_product_attention``
replaced by the plain reference formula (``ReferenceProcessor``).  Models are tiny random
``DiTTransformer2DModel``s and single ``Attention`` modules in the configurations the
processor has to follow (cross-attention, 4-D input with group norm, residual and output
rescaling, spatial norm, q/k norms).
"""

from __future__ import annotations

import copy
import re
from unittest import mock

import pytest
import torch
from diffusers import DiTTransformer2DModel
from diffusers.models import attention_processor as diffusers_ap
from diffusers.models.attention_processor import Attention, AttnAddedKVProcessor, AttnProcessor2_0
from readme_commands import page

from uvic.models.attention_processor import (
    CogAttnProcessor,
    ExpressiveAttnProcessor,
    KernelAttnProcessor,
    SigmoidAttnProcessor,
    SoftmaxAttnProcessor,
    set_cog_attention,
    transformer_blocks,
)
from uvic_kernels import (
    cog_attention_reference,
    expressive_attention_reference,
    sigmoid_attention_reference,
    softmax_attention_reference,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# The kernel's default on CUDA (Triton); on a CPU its PyTorch implementation, the
# fallback a user gets without TRITON_INTERPRET (conftest.py sets it for the kernel tests).
BACKEND = None if CUDA else "torch"
TOL = 1e-5  # relative (Frobenius) error of float32 against float64
REFERENCES = {
    "cog": cog_attention_reference,
    "expressive": expressive_attention_reference,
    "sigmoid": sigmoid_attention_reference,  # bias -log(N keys), the processor's default
    "softmax": softmax_attention_reference,
}
PROCESSOR_CLASSES = {
    "cog": CogAttnProcessor,
    "expressive": ExpressiveAttnProcessor,
    "sigmoid": SigmoidAttnProcessor,
    "softmax": SoftmaxAttnProcessor,
}


@pytest.fixture(autouse=True)
def no_tf32():
    """float32 means float32 on CUDA too (cuDNN convolutions default to TF32)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


class ReferenceProcessor(AttnProcessor2_0):
    """diffusers' AttnProcessor2_0 with scaled_dot_product_attention replaced by the
    reference formula of ``mode`` (run it in float64)."""

    def __init__(self, mode: str, bias: float | None = None) -> None:
        super().__init__()
        self.formula = REFERENCES[mode]
        self.extra = () if bias is None else (bias,)  # sigmoid's bias

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 temb=None):
        def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
            assert attn_mask is None and dropout_p == 0.0 and not is_causal
            return self.formula(q, k, v, scale, *self.extra)

        with mock.patch.object(diffusers_ap.F, "scaled_dot_product_attention", sdpa):
            return super().__call__(attn, hidden_states, encoder_hidden_states,
                                    attention_mask, temb)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| (Frobenius), in float64."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def tiny_dit(num_layers: int = 4, seed: int = 0) -> DiTTransformer2DModel:
    torch.manual_seed(seed)
    model = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=num_layers,
        sample_size=8, patch_size=2, num_embeds_ada_norm=10,
    )
    # eval: DiT drops class labels at random in training mode (classifier-free guidance);
    # gradients are the same in either mode otherwise
    return model.to(DEVICE).eval()


def dit_inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=gen).to(DEVICE),
        "timestep": torch.tensor([3, 700], device=DEVICE),
        "class_labels": torch.tensor([1, 7], device=DEVICE),
    }


def run_dit(model: DiTTransformer2DModel, inputs: dict[str, torch.Tensor]):
    """Output and the gradients of every parameter and of the input, for a fixed
    random cotangent."""
    dtype = next(model.parameters()).dtype
    x = inputs["hidden_states"].detach().to(dtype).requires_grad_()
    model.zero_grad()
    out = model(**{**inputs, "hidden_states": x}).sample
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(cotangent.to(out))
    grads = {name: p.grad for name, p in model.named_parameters()}
    grads["input"] = x.grad
    return out.detach(), grads


def assert_matches(got, ref, tol: float = TOL) -> None:
    """Output and gradients within ``tol`` (relative).  A gradient's error is taken
    relative to its norm or, if larger, 1e-2 of the largest gradient's norm: gradients
    that are zero in exact arithmetic (softmax's key bias) are float noise on both sides."""
    (out, grads), (ref_out, ref_grads) = got, ref
    assert rel_err(out, ref_out) < tol
    assert grads.keys() == ref_grads.keys()
    floor = 1e-2 * max(g.double().norm() for g in ref_grads.values())
    errors = {name: ((grads[name].double() - g.double()).norm() / max(g.double().norm(), floor))
              .item() for name, g in ref_grads.items()}
    assert max(errors.values()) < tol, max(errors.items(), key=lambda kv: kv[1])


def float64_reference(model: DiTTransformer2DModel, modes: dict[str, str]):
    """A float64 copy of ``model`` whose modules in ``modes`` run the reference formula."""
    ref = copy.deepcopy(model).double()
    for name, mode in modes.items():
        ref.get_submodule(name).set_processor(ReferenceProcessor(mode))
    return ref


def test_softmax_processor_equals_attn_processor_2_0_on_dit():
    model = tiny_dit()
    inputs = dit_inputs()
    expected = run_dit(model, inputs)
    assert {type(m.processor) for m in model.modules() if isinstance(m, Attention)} == {
        AttnProcessor2_0}
    changed = set_cog_attention(model, "softmax", backend=BACKEND)
    assert len(changed) == 4
    assert_matches(run_dit(model, inputs), expected)


@pytest.mark.parametrize("mode", ["cog", "expressive", "sigmoid"])
def test_dit_matches_float64_reference(mode):
    """The whole DiT in Cog (expressive, sigmoid) attention against a float64 reference network:
    outputs, every parameter's gradient and the input gradient."""
    model = tiny_dit()
    inputs = dit_inputs()
    changed = set_cog_attention(model, mode, backend=BACKEND)
    assert sorted(changed) == [f"transformer_blocks.{i}.attn1" for i in range(4)]
    assert all(type(p) is PROCESSOR_CLASSES[mode] for p in changed.values())
    got = run_dit(model, inputs)
    assert_matches(got, run_dit(float64_reference(model, dict.fromkeys(changed, mode)), inputs))
    # the test can tell the attention modes apart: softmax is far from the result
    softmax_out, _ = run_dit(float64_reference(model, dict.fromkeys(changed, "softmax")), inputs)
    assert rel_err(got[0], softmax_out) > 100 * TOL


@pytest.mark.parametrize(
    ("option", "blocks"),
    [
        ({"keep_softmax": "first_last"}, [1, 2]),
        ({"blocks": [0, -1]}, [0, 3]),
        ({"blocks": (2,)}, [2]),
    ],
)
def test_chosen_blocks(option, blocks):
    model = tiny_dit()
    inputs = dit_inputs()
    changed = set_cog_attention(model, "cog", backend=BACKEND, **option)
    assert sorted(changed) == [f"transformer_blocks.{i}.attn1" for i in blocks]
    processors = {name: type(m.processor) for name, m in model.named_modules()
                  if isinstance(m, Attention)}
    for name, processor in processors.items():
        assert processor is (CogAttnProcessor if name in changed else AttnProcessor2_0), name
    # the other blocks stay softmax: the mixed network equals its float64 reference
    modes = {name: "cog" if name in changed else "softmax" for name in processors}
    assert_matches(run_dit(model, inputs), run_dit(float64_reference(model, modes), inputs))


def test_transformer_blocks_and_switching_back():
    model = tiny_dit(num_layers=3)
    assert [name for name, _ in transformer_blocks(model)] == [
        f"transformer_blocks.{i}" for i in range(3)]
    set_cog_attention(model, "cog", backend=BACKEND)
    # a module running one of our processors may be switched again (to another mode)
    changed = set_cog_attention(model, "softmax", blocks=[0])
    assert list(changed) == ["transformer_blocks.0.attn1"]
    assert type(model.transformer_blocks[0].attn1.processor) is SoftmaxAttnProcessor
    assert type(model.transformer_blocks[1].attn1.processor) is CogAttnProcessor


def attention_module(config: str) -> tuple[Attention, dict[str, torch.Tensor]]:
    """An ``Attention`` module using the processor features named by ``config``, and its
    inputs."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    if config == "cross":  # encoder states of another width and length (Nk != Nq)
        attn = Attention(16, cross_attention_dim=12, heads=2, dim_head=8, bias=True)
        inputs = {"hidden_states": randn(2, 9, 16), "encoder_hidden_states": randn(2, 5, 12)}
    elif config == "cross_norm_qk_norm":  # norm_cross, norm_q / norm_k
        attn = Attention(16, cross_attention_dim=12, heads=2, dim_head=8,
                         cross_attention_norm="layer_norm", qk_norm="layer_norm")
        inputs = {"hidden_states": randn(2, 9, 16), "encoder_hidden_states": randn(2, 7, 12)}
    elif config == "image":  # 4-D input, group norm, residual, output rescaling (UNet mid-block)
        attn = Attention(8, heads=2, dim_head=4, norm_num_groups=4, residual_connection=True,
                         rescale_output_factor=2.0, bias=True)
        inputs = {"hidden_states": randn(2, 8, 3, 5)}
    elif config == "spatial_norm":  # spatial norm conditioned on temb (MoVQ decoder)
        attn = Attention(32, heads=2, dim_head=4, spatial_norm_dim=3, residual_connection=True)
        inputs = {"hidden_states": randn(2, 32, 4, 4), "temb": randn(2, 3, 2, 2)}
    else:
        raise AssertionError(config)
    return attn.to(DEVICE), inputs


def run_attention(attn: Attention, inputs: dict[str, torch.Tensor]):
    dtype = attn.to_q.weight.dtype
    inputs = {k: v.detach().to(dtype).requires_grad_() for k, v in inputs.items()}
    attn.zero_grad()
    out = attn(**inputs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(out))
    grads = {name: p.grad for name, p in attn.named_parameters() if p.grad is not None}
    grads.update({name: x.grad for name, x in inputs.items()})
    return out.detach(), grads


CONFIGS = ["cross", "cross_norm_qk_norm", "image", "spatial_norm"]


@pytest.mark.parametrize("config", CONFIGS)
def test_softmax_processor_equals_attn_processor_2_0(config):
    attn, inputs = attention_module(config)
    expected = run_attention(attn, inputs)
    attn.set_processor(SoftmaxAttnProcessor(backend=BACKEND))
    assert_matches(run_attention(attn, inputs), expected)


@pytest.mark.parametrize("mode", ["cog", "expressive", "sigmoid"])
@pytest.mark.parametrize("config", CONFIGS)
def test_attention_module_matches_float64_reference(config, mode):
    attn, inputs = attention_module(config)
    attn.set_processor(PROCESSOR_CLASSES[mode](backend=BACKEND))
    got = run_attention(attn, inputs)
    ref = copy.deepcopy(attn).double()
    ref.set_processor(ReferenceProcessor(mode))
    assert_matches(got, run_attention(ref, inputs))


@pytest.mark.parametrize("config", ["cross", "image"])
def test_sigmoid_processor_bias(config):
    """SigmoidAttnProcessor(bias=b): sigmoid(S + b) instead of the default -log N (N keys);
    the two differ, and each matches its float64 reference."""
    attn, inputs = attention_module(config)
    attn.set_processor(SigmoidAttnProcessor(backend=BACKEND, bias=1.5))
    assert repr(attn.processor) == f"SigmoidAttnProcessor(mode='sigmoid', backend={BACKEND!r})"
    got = run_attention(attn, inputs)
    ref = copy.deepcopy(attn).double()
    ref.set_processor(ReferenceProcessor("sigmoid", bias=1.5))
    assert_matches(got, run_attention(ref, inputs))
    attn.set_processor(SigmoidAttnProcessor(backend=BACKEND))
    assert rel_err(run_attention(attn, inputs)[0], got[0]) > 100 * TOL
    one_line_error(lambda: SigmoidAttnProcessor(bias=float("nan")), "bias must be a finite")
    one_line_error(lambda: KernelAttnProcessor("cog", bias=1.0), "sigmoid mode's only")


def test_default_backend_runs_the_kernel():
    """backend=None: Triton on CUDA; on a CPU Triton's interpreter under TRITON_INTERPRET=1
    (conftest.py), else PyTorch.  Equal to the forced PyTorch implementation."""
    attn, inputs = attention_module("cross")
    attn.set_processor(CogAttnProcessor())
    got = run_attention(attn, inputs)
    attn.set_processor(CogAttnProcessor(backend="torch"))
    assert_matches(got, run_attention(attn, inputs))


def test_readme_example(monkeypatch):
    """docs/diffusers.md's Cog-attention example, with a tiny DiT for the hub model."""
    section = page("docs/diffusers.md")
    code = next(block for block in re.findall(r"```python\n(.*?)```", section, flags=re.S)
                if "set_cog_attention" in block)
    loaded = []

    def from_pretrained(name, **kwargs):
        loaded.append(name)
        return tiny_dit()

    monkeypatch.setattr(DiTTransformer2DModel, "from_pretrained", from_pretrained)
    inputs = dit_inputs()
    namespace = {"latents": inputs["hidden_states"], "t": inputs["timestep"],
                 "labels": inputs["class_labels"]}
    exec(compile(code, "docs/diffusers.md", "exec"), namespace)
    assert loaded == ["facebook/DiT-XL-2-256"]
    assert sorted(namespace["changed"]) == [f"transformer_blocks.{i}.attn1" for i in (1, 2)]
    assert namespace["noise_pred"].shape == inputs["hidden_states"].shape


def one_line_error(call, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as info:
        call()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"mode": "cogg"}, r"set_cog_attention: mode must be one of .* got 'cogg'"),
        ({"blocks": [4]}, r"blocks=\[4\]: need block indices in \[-4, 4\) "
                          r"\(DiTTransformer2DModel has 4 transformer blocks\)"),
        ({"blocks": [-5]}, r"blocks=\[-5\]"),
        ({"blocks": []}, r"blocks=\[\]"),
        ({"blocks": [1.0]}, r"blocks=\[1.0\]"),
        ({"blocks": [0], "keep_softmax": "first_last"}, "give blocks or keep_softmax, not both"),
        ({"keep_softmax": "first"}, r"keep_softmax must be one of \('first_last',\)"),
        ({"backend": "sdpa"}, r"CogAttnProcessor: backend='sdpa' runs softmax only"),
        ({"backend": "cuda"}, r"CogAttnProcessor: backend must be one of"),
    ],
)
def test_set_cog_attention_bad_arguments(kwargs, pattern):
    model = tiny_dit()
    one_line_error(lambda: set_cog_attention(model, **kwargs), pattern)
    assert all(type(m.processor) is AttnProcessor2_0
               for m in model.modules() if isinstance(m, Attention))


def test_bad_models():
    one_line_error(lambda: set_cog_attention(torch.nn.Linear(2, 2)),
                   "set_cog_attention: Linear has no diffusers Attention modules")
    one_line_error(lambda: set_cog_attention(tiny_dit(num_layers=2), keep_softmax="first_last"),
                   "needs at least 3 transformer blocks; DiTTransformer2DModel has 2")
    # a module whose processor does more than plain attention is refused, nothing changes
    model = tiny_dit()
    model.transformer_blocks[2].attn1.set_processor(AttnAddedKVProcessor())
    one_line_error(lambda: set_cog_attention(model),
                   "transformer_blocks.2.attn1 runs AttnAddedKVProcessor, not plain attention")
    assert type(model.transformer_blocks[0].attn1.processor) is AttnProcessor2_0


def test_processor_bad_inputs():
    attn, inputs = attention_module("cross")
    attn.set_processor(CogAttnProcessor(backend=BACKEND))
    mask = torch.ones(2, 1, 5, device=DEVICE)
    one_line_error(lambda: attn(**inputs, attention_mask=mask),
                   r"CogAttnProcessor: attention masks are not supported .* shape \(2, 1, 5\)")
    one_line_error(lambda: attn.double()(**{k: v.double() for k, v in inputs.items()}),
                   "dtype torch.float64; supported: float16, bfloat16, float32")
    one_line_error(lambda: KernelAttnProcessor("signed"),
                   "KernelAttnProcessor: mode must be one of")


def test_blocks_that_are_attention_modules():
    """Blocks are named by their path even when the model is itself the block list."""
    model = torch.nn.ModuleList([Attention(8, heads=2, dim_head=4) for _ in range(3)])
    assert [name for name, _ in transformer_blocks(model)] == ["0", "1", "2"]
    assert list(set_cog_attention(model, keep_softmax="first_last")) == ["1"]
    assert type(model[1].processor) is CogAttnProcessor
    assert type(model[0].processor) is type(model[2].processor) is AttnProcessor2_0
