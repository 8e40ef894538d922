"""Attention analysis of U-ViT / U-ViC diffusion models (softmax, Cog and other modes).

    result = analyze({"U-ViT": uvit, "U-ViC": uvic}, cfg, images)   # JSON-ready dict
    write_json("analysis/attention.json", result, indent=1)          # uvic.files
    save_figures(result, "analysis/")                                # {name: png path}

`metrics` holds the measures on plain attention matrices, `capture` recovers each
block's attention matrix with hooks, `core` runs the models, `figures` draws.
"""

from uvic.analysis.capture import HEAD_METRICS, attention_weights
from uvic.analysis.core import (
    SCHEMA_VERSION,
    analyze,
    check_result,
    load_inputs,
    load_models,
    spread_timesteps,
)
from uvic.analysis.figures import save_figures

__all__ = [
    "HEAD_METRICS",
    "SCHEMA_VERSION",
    "analyze",
    "attention_weights",
    "check_result",
    "load_inputs",
    "load_models",
    "save_figures",
    "spread_timesteps",
]
