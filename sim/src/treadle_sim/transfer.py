"""How long a published version takes to reach every rollout replica, by fan-out: the
weight-sync model `engine.Simulation` uses, and `scale` reports at fleet sizes of its own."""

from __future__ import annotations

import math

from treadle_sim.scenario import Weights


def fetch_seconds(w: Weights, weight_bytes: float, n: int) -> tuple[list[float], float]:
    """Seconds from a version's commit until each of `n` replicas holds it under the fan-out
    `w.fanout`, and the seconds of store egress it takes."""
    bits, link = weight_bytes * 8, w.link_gbps * 1e9
    if w.fanout == "store":
        rate = min(link, w.store_egress_gbps * 1e9 / n)
        return [bits / rate] * n, bits * n / (w.store_egress_gbps * 1e9)
    hop = w.chunk_mb * 2**20 * 8 / link
    store_s = bits / (w.store_egress_gbps * 1e9)
    if w.fanout == "relay":  # a pipelined chain: replica i is i chunks behind the first
        first = bits / min(link, w.store_egress_gbps * 1e9)
        return [first + i * hop for i in range(n)], store_s
    return [bits / link + math.ceil(math.log2(max(n, 2))) * hop] * n, store_s
