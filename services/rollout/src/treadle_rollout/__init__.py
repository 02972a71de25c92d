"""Treadle rollout service: serves the policy, runs episodes, records trajectories."""
