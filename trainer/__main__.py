"""`python -m trainer`: train under the Lockstep launch contract (or torchrun, or alone)."""

import multiprocessing
import os
import sys

from trainer.train import main

code = main()
# Everything the run owes is written and closed by now (checkpoint committed, metrics file
# closed, process group left). Skipping interpreter finalization avoids a known class of exit
# hangs and aborts when torch's communication threads are torn down during it. Daemon children
# (DCP's process-based checkpoint writer) are ended first, as multiprocessing's own exit
# handler would have done.
for child in multiprocessing.active_children():
    if child.daemon:
        child.terminate()
        child.join(timeout=10)
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
