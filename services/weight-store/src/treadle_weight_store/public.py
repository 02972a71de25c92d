"""What Treadle's weight store offers code outside the service (the benchmarks, extensions):
the store over a local backend and its gRPC servicer (to serve it in-process). Anything else in
`treadle_weight_store` is internal and may change; `make lint` holds the benchmarks to this
module.
"""

from treadle_weight_store.backends.local import LocalBackend
from treadle_weight_store.grpc import WeightStoreServicer, add_to_server
from treadle_weight_store.store import WeightStore

__all__ = ["LocalBackend", "WeightStore", "WeightStoreServicer", "add_to_server"]
