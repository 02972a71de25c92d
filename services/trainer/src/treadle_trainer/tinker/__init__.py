"""Treadle as a self-hosted Tinker: the SDK's REST surface (`api.py`), its protobuf bodies
(`wire.py`), futures (`futures.py`) and LoRA training clients sharing base models
(`adapters.py`)."""
