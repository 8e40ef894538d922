"""Attention-head superposition: the skip-trigram toy task and its models in every attention
design, how many trigrams a layer holds (capacity), copy-and-suppress, and gated attention
blocks (Mathwin et al. 2024), distilled from toy or real models (docs/gated_attention.md)."""
