"""worker package.

Passive OpenMP waiting, set before the worker imports torch (a value in the environment wins):
see higgs_cli/__init__.py for why spinning threads are slow on a shared CPU.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
