"""Treadle trainer service: owns runs, turns trajectories into policy updates, publishes weights."""
