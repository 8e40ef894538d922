"""Markdown version of the paper's Table 3 from a folder of `eval/fid.py` result JSONs.

This file runs `uvic.cli.fid_table` (installed as `uvic-fid-table`); see there for the options.
"""

import sys

from uvic.cli.fid_table import main

if __name__ == "__main__":
    sys.exit(main())
