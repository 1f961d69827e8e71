"""``python -m sacpass``: see :mod:`sacpass.cli`."""
import sys

from .cli import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `python -m sacpass report DIR | head`
        sys.exit(0)
