"""What configures a run and a stack: recipes, TREADLE_* settings, every Redis/NATS name."""
