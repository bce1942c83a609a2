"""``python -m numbafuse.train``: the command line of :mod:`numbafuse.cli`."""
import sys

from ..cli import main

sys.exit(main())
