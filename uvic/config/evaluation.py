"""The rules on `eval.*` values: clean-fid modes and the feature extractors.

Read by `uvic.evaluation.statistics`, by `uvic.config.validation` and by the CLI (`--mode`,
`--features` choices); no torch here.
"""

from __future__ import annotations

from uvic.config import EvalConfig, require

FID_MODES = ("clean", "legacy_pytorch", "legacy_tensorflow")  # clean-fid's modes
# eval.features: Inception (real FID) or the download-free random projection (a stand-in
# whose numbers are not comparable with Inception FID;
# `uvic.evaluation.statistics.ProjectionFeatures`)
FID_FEATURES = ("inception", "projection")


def check_eval(e: EvalConfig) -> None:
    """The rules on `eval.*` values."""
    require([
        (e.mode in FID_MODES, f"eval.mode={e.mode!r} must be one of {FID_MODES}"),
        (e.features in FID_FEATURES,
         f"eval.features={e.features!r} must be one of {FID_FEATURES}"),
        (e.n_samples >= 2, f"eval.n_samples={e.n_samples} must be >= 2"),
    ])


def check_mode(mode: str) -> str:
    """A clean-fid mode passed to the statistics functions (e.g. `uvic-fid --mode`)."""
    if mode not in FID_MODES:
        raise ValueError(f"eval.mode must be one of {FID_MODES}, got {mode!r}")
    return mode
