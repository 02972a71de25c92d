"""Treadle common library: wire contracts, settings, recipes, names, clients, lifecycle, CLI.

Map:
- `proto/`        generated protobuf + gRPC stubs (source: libs/common/proto, regenerate with
                  scripts/gen_protos.py)
- `settings`      infrastructure endpoints and ports from the environment (TREADLE_*)
- `config`        recipe models (YAML + `--set a.b=c` overrides)
- `names`         every Redis key, NATS subject and default port
- `clients/`      thin async clients: weight-store, env-gateway, reward, Redis streams
- `service`       the standard service lifecycle (HTTP probes, heartbeats, drain on SIGTERM)
- `infra`         embedded redis-server / nats-server / weed (S3) for local runs
- `stack`         `treadle up/down/status`: the five services as supervised processes
- `cli`           the `treadle` command
"""

__version__ = "0.1.0"
