"""`python -m trainer`: train under the Lockstep launch contract (or torchrun, or alone)."""

import sys

from trainer.train import main

sys.exit(main())
