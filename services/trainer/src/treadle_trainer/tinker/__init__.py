"""Treadle as a self-hosted Tinker: the SDK's REST surface (`api_router.py`) over the sessions
and ownership (`state.py`), training clients (`training.py`: LoRA adapters sharing base models,
`adapters.py`), sampling (`sampling_sessions.py`, through rollout: `sampling.py`), futures
(`futures.py`) and the protobuf bodies (`wire.py`)."""
