"""``python -m autopar.cli ...``: the ``autopar`` command."""

import sys

from autopar.cli import main

if __name__ == "__main__":
    sys.exit(main())
