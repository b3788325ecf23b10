"""`python -m nodeagent ...`: the node agent's command line."""

import sys

from nodeagent.cli import main

sys.exit(main())
