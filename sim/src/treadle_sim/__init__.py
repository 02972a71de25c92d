"""`treadle sim`: a discrete-event simulator of a Treadle fleet that drives Treadle's own
scheduling code (admission, group assembly, the step's batch) in simulated time."""
