"""Many runs on one fleet: admission, scheduling, pacing, quotas, retention."""
