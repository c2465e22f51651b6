"""higgs_cli package.

OpenMP threads that spin while they wait for work (the default, "active" policy) turn every
small tensor operation into a fight for the cores as soon as anything else runs on the machine:
a dynamic run's quantization of SmolLM2 took 110 s with spinning threads beside other work and
7.9 s with passive ones (docs/benchmarks.md, "Speed on a CPU"). The policy is read once, when torch loads its OpenMP
runtime, so it is set here, before any command imports torch; a value in the environment wins.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
