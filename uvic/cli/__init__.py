"""Command-line programs, installed as `uvic-train`, `uvic-sample` and `uvic-fid`; the files
in `scripts/` and `eval/` run the same `main`."""
