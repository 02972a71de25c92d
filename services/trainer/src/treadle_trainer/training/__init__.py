"""The caller-owned training API (`/v1/training`): `sessions.py` is the core (a model and its
optimizer per session, no HTTP), `api_router.py` its HTTP edge."""
