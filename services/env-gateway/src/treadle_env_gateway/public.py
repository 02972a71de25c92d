"""What Treadle's env-gateway offers code outside the service (the benchmarks, extensions):
the env registry and the env types, the sandbox, the gRPC servicer over a session manager
(to serve envs in-process), and the latency models (`Latency`, what `treadle sim` draws an
env step's time from). Anything else in `treadle_env_gateway` is internal and may change;
`make lint` holds the benchmarks to this module.
"""

from treadle_env_gateway.envs import registry as env_registry
from treadle_env_gateway.envs.arith import Arith
from treadle_env_gateway.envs.base import Action
from treadle_env_gateway.grpc import EnvGatewayServicer
from treadle_env_gateway.latency import Latency
from treadle_env_gateway.sandbox.runner import Sandbox
from treadle_env_gateway.sessions import SessionManager

__all__ = [
    "Action",
    "Arith",
    "EnvGatewayServicer",
    "Latency",
    "Sandbox",
    "SessionManager",
    "env_registry",
]
