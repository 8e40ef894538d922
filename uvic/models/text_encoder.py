"""CLIP ViT-L/14 text features for text-to-image U-ViT / U-ViC (the release's conditioning):
the 77 token states after the text transformer's final LayerNorm, not the pooled vector,
computed with open_clip's model (QuickGELU for OpenAI's weights) and tokenized exactly as
the release's transformers ``CLIPTokenizer`` does (`ReleaseTokenizer`; docs/conventions.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import ftfy
import open_clip
import regex
import torch
from open_clip.transformer import TextTransformer
from torch import nn

CONTEXT_LENGTH = 77
DEFAULT_MODEL = "ViT-L-14-quickgelu"
DEFAULT_PRETRAINED = "openai"
# Where OpenAI's ViT-L/14 weights live in open_clip format on the Hugging Face Hub.
OPENAI_L14_HUB = "timm/vit_large_patch14_clip_224.openai"


class ClipLoadError(RuntimeError):
    """The CLIP text encoder could not be built or its weights were not found."""


SOT_TEXT, EOT_TEXT = "<|startoftext|>", "<|endoftext|>"
# transformers' CLIPTokenizer: added tokens split first, then this pattern (IGNORECASE) on
# each cleaned piece; a piece equal to a special token's text maps to its id (its BPE cache).
_SPECIAL = re.compile(r"(<\|startoftext\|>|<\|endoftext\|>)")
_PIECES = regex.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|"""
    r"""[^\s\p{L}\p{N}]+""",
    regex.IGNORECASE,
)


class ReleaseTokenizer:
    """CLIP tokenization as the release's ``CLIPTokenizer(truncation=True, max_length=77,
    padding="max_length")``, on open_clip's BPE vocabulary (the same 49408 tokens).

    Ids: start, the caption's BPE tokens (truncated to 75), end, then end-of-text padding
    (not open_clip's 0: U-ViT attends to all 77 states). Cleaning as the release's (no double
    HTML-unescape); ``<|startoftext|>`` / ``<|endoftext|>`` in a caption are special ids.
    """

    def __init__(self, bpe: open_clip.SimpleTokenizer | None = None,
                 context_length: int = CONTEXT_LENGTH) -> None:
        self.bpe = bpe or open_clip.SimpleTokenizer()
        if not isinstance(self.bpe, open_clip.SimpleTokenizer):
            raise ClipLoadError(f"needs CLIP's BPE tokenizer, got {type(self.bpe).__name__}")
        self.sot_id, self.eot_id = int(self.bpe.sot_token_id), int(self.bpe.eot_token_id)
        self.context_length = context_length
        self._special = {SOT_TEXT: self.sot_id, EOT_TEXT: self.eot_id}

    def encode(self, text: str) -> list[int]:
        """BPE ids of a caption, without start/end tokens and untruncated."""
        ids: list[int] = []
        for chunk in _SPECIAL.split(text):
            if chunk in self._special:
                ids.append(self._special[chunk])
                continue
            clean = re.sub(r"\s+", " ", ftfy.fix_text(chunk)).strip().lower()
            for piece in _PIECES.findall(clean):
                if piece in self._special:
                    ids.append(self._special[piece])
                    continue
                token = "".join(self.bpe.byte_encoder[b] for b in piece.encode("utf-8"))
                ids.extend(self.bpe.encoder[t] for t in self.bpe.bpe(token).split(" "))
        return ids

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        """(n, context_length) int64 ids of `texts`."""
        if isinstance(texts, str):
            raise TypeError("tokenize expects a list of strings, not a single str")
        n = self.context_length
        out = torch.full((len(texts), n), self.eot_id, dtype=torch.int64)
        for row, text in enumerate(texts):
            ids = [self.sot_id, *self.encode(text)[: n - 2], self.eot_id]
            out[row, : len(ids)] = torch.tensor(ids)
        return out


def _looks_like_path(value: str) -> bool:
    return value.startswith((".", "/", "~")) or os.sep in value or value.endswith(
        (".pt", ".pth", ".bin", ".safetensors")
    )


def load_open_clip(
    model_name: str = DEFAULT_MODEL,
    pretrained: str | None = DEFAULT_PRETRAINED,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Build an open_clip model with its weights; a clear one-line error when they are missing.

    `model_name` is a built-in open_clip name, or ``local-dir:FOLDER`` / ``hf-hub:ORG/NAME``
    (then `pretrained` is ignored). `pretrained` is an open_clip tag ("openai") or a local
    checkpoint file (``open_clip_model.safetensors`` / ``open_clip_pytorch_model.bin`` /
    OpenAI's ``ViT-L-14.pt``).
    """
    schema = model_name.split(":", 1)[0] if ":" in model_name else None
    if schema == "local-dir":
        folder = Path(model_name.split(":", 1)[1])
        if not (folder / "open_clip_config.json").is_file():
            raise ClipLoadError(f"open_clip folder {folder} has no open_clip_config.json")
    if schema is not None:
        pretrained = None
    elif not pretrained:
        raise ClipLoadError(f"no CLIP weights given for {model_name!r} (data.clip_pretrained is "
                            "empty): use 'openai' or a local checkpoint path")
    elif _looks_like_path(pretrained):
        path = Path(pretrained).expanduser()
        if not path.is_file():
            raise ClipLoadError(
                f"CLIP checkpoint not found: {path} (download {OPENAI_L14_HUB} "
                "open_clip_model.safetensors and pass its path via data.clip_pretrained)"
            )
        pretrained = str(path)
    force_quick_gelu = pretrained == "openai"  # OpenAI's weights use QuickGELU
    try:
        model = open_clip.create_model(
            model_name, pretrained=pretrained or None, device=device,
            force_quick_gelu=force_quick_gelu,
        )
    except (RuntimeError, OSError, ValueError) as err:
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ClipLoadError(
            f"could not load open_clip {model_name!r} with pretrained={pretrained!r} "
            f"({first_line}); offline? run `huggingface-cli download {OPENAI_L14_HUB} "
            "open_clip_model.safetensors --local-dir models/clip-vit-l-14` and pass "
            "--set data.clip_pretrained=models/clip-vit-l-14/open_clip_model.safetensors"
        ) from err
    return model.eval()


class ClipTextEncoder(nn.Module):
    """Per-token CLIP text states, (n, 77, width), padded and computed the release's way.

    Either loads open_clip `model_name` / `pretrained`, or wraps a pre-built open_clip
    model passed as `model` (tests use tiny random ones). Only the text tower is kept.
    """

    def __init__(
        self,
        model_name: str = DEFAULT_MODEL,
        pretrained: str | None = DEFAULT_PRETRAINED,
        device: str | torch.device = "cpu",
        *,
        model: nn.Module | None = None,
        tokenizer: open_clip.SimpleTokenizer | None = None,
    ) -> None:
        super().__init__()
        if model is None:
            model = load_open_clip(model_name, pretrained, device)
        # open_clip's CLIP keeps the text modules at top level; CustomTextCLIP in `.text`.
        text = getattr(model, "text", None)
        source = text if isinstance(text, TextTransformer) else model
        if getattr(source, "cls_emb", None) is not None:
            raise ClipLoadError(f"{model_name}: text towers with a CLS embedding are unsupported")
        self.token_embedding = source.token_embedding
        self.positional_embedding = source.positional_embedding
        self.transformer = source.transformer
        self.ln_final = source.ln_final
        if source.attn_mask is None:
            raise ClipLoadError(f"{model_name}: text tower is not causal; not a CLIP text model")
        self.register_buffer("attn_mask", source.attn_mask.clone(), persistent=False)
        self.context_length = int(self.positional_embedding.shape[0])
        self.width = int(self.positional_embedding.shape[1])
        self.tokenizer = ReleaseTokenizer(tokenizer or open_clip.get_tokenizer(model_name),
                                          self.context_length)
        self.eot_id = self.tokenizer.eot_id
        self.requires_grad_(False)
        self.eval()
        self.to(device)

    @property
    def device(self) -> torch.device:
        return self.positional_embedding.device

    def tokenize(self, texts: Sequence[str]) -> torch.Tensor:
        """(n, 77) int64 token ids, the release's (`ReleaseTokenizer`): start, BPE tokens
        (truncated to keep end-of-text at the last position), end-of-text, then
        end-of-text padding."""
        if isinstance(texts, str):
            raise TypeError("tokenize expects a list of strings, not a single str")
        return self.tokenizer(list(texts))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (n, 77) -> text transformer states after ln_final, (n, 77, width)."""
        cast_dtype = self.transformer.get_cast_dtype()
        x = self.token_embedding(tokens.to(self.device)).to(cast_dtype)  # (n, L, width)
        x = x + self.positional_embedding.to(cast_dtype)
        x = self.transformer(x, attn_mask=self.attn_mask)  # causal, batch-first
        return self.ln_final(x)

    @torch.no_grad()
    def encode(self, texts: Sequence[str], batch_size: int = 256) -> torch.Tensor:
        """Captions -> float32 (n, 77, width) on the encoder's device."""
        texts = list(texts)
        out = torch.empty(len(texts), self.context_length, self.width, device=self.device)
        for start in range(0, len(texts), batch_size):
            tokens = self.tokenize(texts[start : start + batch_size])
            out[start : start + len(tokens)] = self(tokens).float()
        return out
