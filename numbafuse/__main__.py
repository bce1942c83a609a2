"""``python -m numbafuse``: the training demo (same as ``python -m numbafuse.train``)."""
import sys

from .train import main

sys.exit(main())
