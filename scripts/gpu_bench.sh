#!/bin/bash
# On a lent GPU machine (the device tool; see docs/guides/gpu.md): Treadle's trainer and
# rollout benches on CUDA, from this checkout and what `scripts/gpu_carry.py` put in .dev/.
#   bash scripts/gpu_bench.sh [BENCH ARGS ...]    default: "overlap", "trainer", "rollout"
#   TREADLE_TRAINER_PUBLISH_WORKER=never bash scripts/gpu_bench.sh trainer   (publish inline)
# Each bench's JSON lands in $OUT (the trainer's profiled steps in $OUT/profile); one that
# runs past its time dumps every thread's stack and the logs of the services it started.
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .dev/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/libs/*/src "$PWD"/services/*/src "$PWD"/bench/src | tr '\n' ':')
mkdir -p /tmp/bin && for b in nats-server redis-server; do
  [ -x /tmp/bin/$b ] || { gunzip -c .dev/bin/$b.gz > /tmp/bin/$b && chmod +x /tmp/bin/$b; }
done
export PATH=/tmp/bin:$PATH PYTHONUNBUFFERED=1 TREADLE_STATE_DIR=/tmp/treadle-state
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
python3 - <<'PY' || exit 4
# the imported model's shapes with seeded random weights (its real ones do not travel)
import shutil
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = Path(".dev/model"), Path("/tmp/models/model")
if not (dst / "model.safetensors").exists():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copy(f, dst / f.name)
print("model", sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(dst).parameters()))
PY
BENCH="import sys, signal, faulthandler; faulthandler.register(signal.SIGUSR1, all_threads=True); from treadle_bench.cli import app; sys.argv[0] = 'treadle-bench'; app()"
run() {  # NAME SECONDS ARGS...
  local name=$1 secs=$2; shift 2; local start=$SECONDS
  timeout -s USR1 -k 10 "$secs" python3 -c "$BENCH" "$@" --model /tmp/models/model --json \
    > "$OUT/$name.json" 2> "$OUT/$name.err"
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - start)) s"; cat "$OUT/$name.json"
  if [ $rc -ne 0 ]; then
    tail -c 4000 "$OUT/$name.err"
    for log in /tmp/tmp*/*.log /tmp/tmp*/*/*.log; do [ -f "$log" ] && { echo "-- $log"; tail -n 30 "$log"; }; done
    pkill -f treadle_ ; pkill -f redis-server ; pkill -f nats-server
  fi
}
if [ $# -gt 0 ]; then run bench 300 "$@"; else
  run overlap 150 overlap --device cuda --seconds 5 --rounds 3
  run trainer 200 trainer --profile-dir "$OUT/profile"   # one more step of each, profiled
  run rollout 200 rollout
fi
