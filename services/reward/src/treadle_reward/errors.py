"""What the reward service refuses a caller with (HTTP; over NATS a failed score is a status in
its result, never an error). Each error's status is its class's (`treadle_common.runtime.errors`),
answered by the service runtime.

| error | HTTP | when |
|---|---|---|
| `UnknownScorer` | 404 | no scorer of that name on this replica |
| request validation | 422 | a body that does not match `ScoreBody` (FastAPI) |
"""

from __future__ import annotations

from treadle_common.runtime import errors


class UnknownScorer(errors.NotFound):
    """No scorer of that name is registered on this replica."""
