"""The rules on `eval.*` values: clean-fid modes, the feature extractors and the metrics.

Read by `uvic.evaluation.statistics`, by `uvic.config.validation` and by the CLI (`--mode`,
`--features`, `--metrics` choices); no torch here.
"""

from __future__ import annotations

from uvic.config import EvalConfig, require

FID_MODES = ("clean", "legacy_pytorch", "legacy_tensorflow")  # clean-fid's modes
# eval.features: Inception (real FID) or the download-free random projection (a stand-in
# whose numbers are not comparable with Inception FID;
# `uvic.evaluation.statistics.ProjectionFeatures`)
FID_FEATURES = ("inception", "projection")
# eval.metrics: FID always, FD-DINOv2 and precision/recall beside it (uvic.evaluation.metrics)
METRICS = ("fid", "fd_dinov2", "precision_recall")
# eval.pr_features: the features precision/recall's k-NN radii live in ("inception": the
# extractor FID uses, eval.features')
PR_FEATURES = ("inception", "dinov2")


def check_eval(e: EvalConfig) -> None:
    """The rules on `eval.*` values."""
    unknown = [m for m in e.metrics if m not in METRICS]
    require([
        (e.mode in FID_MODES, f"eval.mode={e.mode!r} must be one of {FID_MODES}"),
        (e.features in FID_FEATURES,
         f"eval.features={e.features!r} must be one of {FID_FEATURES}"),
        (e.n_samples >= 2, f"eval.n_samples={e.n_samples} must be >= 2"),
        (not unknown, f"eval.metrics: {unknown[0] if unknown else ''!r} is not one of "
         f"{METRICS}"),
        ("fid" in e.metrics, f"eval.metrics={','.join(e.metrics) or '()'} must include fid "
         "(the others are reported beside it)"),
        (len(set(e.metrics)) == len(e.metrics),
         f"eval.metrics={','.join(e.metrics)} names a metric twice"),
        (e.pr_k >= 1, f"eval.pr_k={e.pr_k} must be >= 1"),
        (e.pr_features in PR_FEATURES,
         f"eval.pr_features={e.pr_features!r} must be one of {PR_FEATURES}"),
        (e.pr_n_ref >= 0, f"eval.pr_n_ref={e.pr_n_ref} must be >= 0 (0: as many as samples)"),
    ])


def check_mode(mode: str) -> str:
    """A clean-fid mode passed to the statistics functions (e.g. `uvic-fid --mode`)."""
    if mode not in FID_MODES:
        raise ValueError(f"eval.mode must be one of {FID_MODES}, got {mode!r}")
    return mode
