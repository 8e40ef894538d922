"""FID / KID of a checkpoint with clean-fid (the paper's Table 3 protocol by default).

This file runs `uvic.cli.fid` (installed as `uvic-fid`); see there for the options.
"""

import sys

from uvic.cli.fid import main

if __name__ == "__main__":
    sys.exit(main())
