"""U-ViT's attention module and diffusers' attention-processor interface on `UViT`.

A block's `Attention` hands the attention op to its *processor*, as diffusers' attention
modules do: one of `uvic.models.attention_processor`'s kernel processors (the same
objects that run Cog, expressive or softmax attention in diffusers' own transformers),
one per mode from `kernel_processor`. A processor carries the mode and the kernel backend
(None: the kernel picks). The weights stay the release's: a fused `qkv` projection and
`proj`.

`ProcessorsMixin` gives `UViT` diffusers' interface over them:

* `attn_processors`: {"in_blocks.0.attn.processor": processor, ...}, blocks in order;
* `set_attn_processor(p)`: one processor for every block, or a dict with exactly the
  keys of `attn_processors`;
* `set_default_attn_processor()`: softmax in every block (U-ViT), the backend kept;
* `set_attention(spec, backend)`: uvic's form, a preset or per-block list of modes.

Each records the pattern in the model's config (`attention`, `attention_backend`), so
`save_pretrained` / `from_pretrained` rebuild the model with the attention it runs now
(a block's own `set_processor`, diffusers' module-level call, changes that block only).
A processor that is not a kernel processor, a dict with other keys, or processors that
disagree on the backend (the config has one) are refused with one ValueError, and the
model is left as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import einops
from torch import Tensor, nn

from uvic.config.models import (
    ATTENTION_MODES,
    AUTO_BACKEND,
    check_backend_fits,
    kernel_backend,
    resolve_attention,
)
from uvic.models.attention_processor import KernelAttnProcessor, kernel_processor


class Attention(nn.Module):
    """Multi-head self-attention whose op is its processor's (`mode`, `backend`).

    (B, N, D) -> qkv (B, N, 3D) -> q, k, v (B, h, N, D/h) -> kernel -> (B, N, D) -> proj.
    Sigmoid mode's bias is the processor's if it has one, else `sigmoid_bias` (set by
    `UViT`): None (-log N), a number, or a learnable parameter per head (h,).
    """

    def __init__(
        self, dim: int, num_heads: int, qkv_bias: bool = False, mode: str = "softmax",
        backend: str | None = None,
    ) -> None:
        super().__init__()
        if mode not in ATTENTION_MODES:
            raise ValueError(f"attention mode {mode!r} is not one of {ATTENTION_MODES}")
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.processor: KernelAttnProcessor = kernel_processor(mode, backend)
        self.sigmoid_bias: float | nn.Parameter | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.processor(self, x)

    def fused_attention(self, x: Tensor, processor: KernelAttnProcessor) -> Tensor:
        """The block's attention with `processor`'s kernel (what the processor calls)."""
        # Non-contiguous (B, h, N, D/h) views; the kernel accepts strided inputs.
        q, k, v = einops.rearrange(self.qkv(x), "B N (K h d) -> K B h N d", K=3,
                                   h=self.num_heads)
        out = processor.attend(q, k, v, scale=self.scale, bias=self.sigmoid_bias)
        return self.proj(einops.rearrange(out, "B h N d -> B N (h d)"))

    # diffusers' module interface (AttentionModuleMixin's names)
    def get_processor(self) -> KernelAttnProcessor:
        return self.processor

    def set_processor(self, processor: KernelAttnProcessor) -> None:
        check_processor(processor, "processor")
        self.processor = processor

    @property
    def mode(self) -> str:
        return self.processor.mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self.processor = _with(self.processor, mode=mode)

    @property
    def backend(self) -> str | None:
        return self.processor.backend

    @backend.setter
    def backend(self, backend: str | None) -> None:
        self.processor = _with(self.processor, backend=backend)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, num_heads={self.num_heads}, backend={self.backend!r}"


def _with(processor: KernelAttnProcessor, **field: str | None) -> KernelAttnProcessor:
    """`processor` with one field changed: the mode's own processor where there is one;
    a value no processor takes is kept as given (refused where it is used, as an
    attribute set always was)."""
    mode, backend = field.get("mode", processor.mode), field.get("backend", processor.backend)
    try:
        return kernel_processor(mode, backend)
    except ValueError:
        changed = copy.copy(processor)
        changed.mode, changed.backend = mode, backend
        return changed


def check_processor(processor: object, key: str) -> None:
    """A U-ViT block runs uvic's kernel processors only (diffusers' own processors work
    on diffusers' Attention modules, with separate q/k/v projections)."""
    if not isinstance(processor, KernelAttnProcessor):
        raise ValueError(
            f"{key}: UViT's attention takes uvic's kernel processors (KernelAttnProcessor: "
            f"CogAttnProcessor, SoftmaxAttnProcessor, ExpressiveAttnProcessor, ... or "
            f"uvic.models.attention_processor.kernel_processor(mode)), got "
            f"{type(processor).__name__}")


class ProcessorsMixin:
    """diffusers' attention-processor interface for a model whose `blocks()` have `attn`."""

    def _attention_modules(self) -> dict[str, Attention]:
        return {name: m for name, m in self.named_modules() if isinstance(m, Attention)}

    @property
    def attn_processors(self) -> dict[str, KernelAttnProcessor]:
        """{"<module path>.processor": processor} of every block, in order."""
        return {f"{name}.processor": m.processor for name, m in self._attention_modules().items()}

    @property
    def attention_modes(self) -> list[str]:
        """Current per-block attention modes (depth + 1 entries)."""
        return [m.mode for m in self._attention_modules().values()]

    def set_attn_processor(
        self, processor: KernelAttnProcessor | Mapping[str, KernelAttnProcessor],
    ) -> None:
        """One processor for every block, or {key of `attn_processors`: processor}."""
        keys = list(self.attn_processors)
        if isinstance(processor, Mapping):
            missing = [k for k in keys if k not in processor]
            unknown = [k for k in processor if k not in keys]
            if missing or unknown:
                raise ValueError(
                    f"set_attn_processor: the dict must have exactly the keys of "
                    f"attn_processors ({len(keys)}, e.g. {keys[0]!r}); missing {missing}, "
                    f"unknown {unknown}")
            chosen = [processor[k] for k in keys]
        else:
            chosen = [processor] * len(keys)
        for key, p in zip(keys, chosen):
            check_processor(p, f"set_attn_processor: {key}")
        backends = {p.backend for p in chosen}
        if len(backends) > 1:
            raise ValueError(
                f"set_attn_processor: the processors use the kernel backends "
                f"{sorted(map(str, backends))}; UViT's config records one "
                "(model.attention_backend): give them one backend")
        modes = [p.mode for p in chosen]
        check_backend_fits(chosen[0].backend, modes)
        stored = self.config.attention
        same = isinstance(stored, str) and resolve_attention(stored, self.depth) == modes
        self._use(chosen, stored if same else modes, _backend_name(chosen[0].backend))

    def set_default_attn_processor(self) -> None:
        """Softmax attention in every block (U-ViT), on the kernel backend in use."""
        backend = next(iter(self.attn_processors.values())).backend
        self._use([kernel_processor("softmax", backend)] * (self.depth + 1), "uvit",
                  _backend_name(backend))

    def set_attention(self, spec: str | Sequence[str], backend: str | None = None) -> None:
        """Switch the per-block pattern in place (e.g. load U-ViT weights, run as U-ViC).

        `backend`, if given, is "auto", "triton" or "torch" and is set on every block.
        """
        modes = resolve_attention(spec, self.depth)
        kernel = (next(iter(self.attn_processors.values())).backend if backend is None
                  else kernel_backend(backend, label="attention backend "))
        check_backend_fits(kernel, modes)
        self._use([kernel_processor(mode, kernel) for mode in modes],
                  spec if isinstance(spec, str) else modes, backend)

    def _use(self, processors: list[KernelAttnProcessor], spec: str | list[str],
             backend: str | None) -> None:
        """Put the processors on the blocks; the diffusers config (save_pretrained) records
        the pattern the model now runs, and the backend when `backend` is a name."""
        for module, processor in zip(self._attention_modules().values(), processors):
            module.processor = processor
        self._set_sigmoid_biases()  # the model's bias in each block now sigmoid
        self.register_to_config(attention=spec)
        if backend is not None:
            self.register_to_config(attention_backend=backend)


def _backend_name(backend: str | None) -> str:
    """`model.attention_backend`'s name of a kernel backend (None: the kernel picks)."""
    return AUTO_BACKEND if backend is None else backend
