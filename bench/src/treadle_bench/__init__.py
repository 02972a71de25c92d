"""`treadle bench` workloads. Each measures Treadle's path and a raw baseline of the same work
in the same run, and prints JSON with the ratio."""
