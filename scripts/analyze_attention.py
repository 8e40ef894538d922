"""Measure and draw how the attention of U-ViT / U-ViC checkpoints differs, block by block.

This file runs `uvic.cli.analyze_attention` (installed as `uvic-analyze-attention`); see
there for the options.
"""

import sys

from uvic.cli.analyze_attention import main

if __name__ == "__main__":
    sys.exit(main())
