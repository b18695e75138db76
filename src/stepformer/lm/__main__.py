"""``python -m stepformer.lm``: the same as ``stepformer-lm``."""

import sys

from stepformer.lm.cli import main

sys.exit(main())
