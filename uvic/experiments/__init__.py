"""Experiments: runs of many configs (the paper's and the release's tables, the comparison of
designs, the quickstart) on one resumable runner, with their plans, ETA and reports. The
programs in `uvic.cli` parse arguments and call these."""
