"""FID / KID of a checkpoint with clean-fid, under the U-ViT release's protocol by default.

This file runs `uvic.cli.fid` (installed as `uvic-fid`); see there for the options.
"""

import sys

from uvic.cli.fid import main

if __name__ == "__main__":
    sys.exit(main())
