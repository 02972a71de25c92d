"""What Treadle's reward service offers code outside the service (the benchmarks, extensions):
the scorer registry, `register` for a new scorer, and the scorer types. Anything else in
`treadle_reward` is internal and may change; `make lint` holds the benchmarks to this module.
"""

from treadle_reward.scorers import register
from treadle_reward.scorers import registry as scorer_registry
from treadle_reward.scorers.base import Score, ScoreInput, Scorer

__all__ = ["Score", "ScoreInput", "Scorer", "register", "scorer_registry"]
