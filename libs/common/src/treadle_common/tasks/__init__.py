"""Task-side helpers: the held-out evaluation split, safe arithmetic on model text."""
