"""Gated attention blocks and the skip-trigram experiments in every attention mode.

This file runs `uvic.cli.gated_attention` (installed as `uvic-gated-attention`); see
there for the options.
"""

import sys

from uvic.cli.gated_attention import main

if __name__ == "__main__":
    sys.exit(main())
