"""``python -m numbafuse``: the training demo (same as ``python -m numbafuse.train``)."""
import sys

from .cli import main

sys.exit(main())
