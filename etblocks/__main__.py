"""`python -m etblocks`: the same as the `etblocks` command."""

import sys

from etblocks.cli import main

if __name__ == "__main__":
    sys.exit(main())
