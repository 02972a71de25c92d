"""What Treadle's rollout offers code outside the service (the benchmarks, the simulator,
extensions): its engine, sampling, the token-exact transcript, the session-free prompt and
the fair share of a replica's task slots among runs (`FairShare`). Anything else in
`treadle_rollout` is internal and may change; `make lint` holds the benchmarks to this module.
"""

from treadle_rollout.chat import session_free_prompt
from treadle_rollout.engines import cpus
from treadle_rollout.engines.base import Engine, Generation, Sampling
from treadle_rollout.engines.hf import HFEngine
from treadle_rollout.fair_share import FairShare
from treadle_rollout.transcript import Transcript

__all__ = [
    "Engine",
    "FairShare",
    "Generation",
    "HFEngine",
    "Sampling",
    "Transcript",
    "cpus",
    "session_free_prompt",
]
