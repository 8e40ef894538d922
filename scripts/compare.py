"""Compare model variants over several seeds at matched steps, with paired intervals.

This file runs `uvic.cli.compare` (installed as `uvic-compare`); see there for the options.
"""

import sys

from uvic.cli.compare import main

if __name__ == "__main__":
    sys.exit(main())
