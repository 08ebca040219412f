"""``python -m relprop ...``: the same as the ``relprop`` console command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
