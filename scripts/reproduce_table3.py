"""Table 3 end to end: train, then FID, then the table, for every (dataset, model) pair.

This file runs `uvic.cli.table3` (installed as `uvic-table3`); see there for the options.
"""

import sys

from uvic.cli.table3 import main

if __name__ == "__main__":
    sys.exit(main())
