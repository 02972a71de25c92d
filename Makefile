# Treadle — thin targets; the README names them.
#   make setup   create .venv and install the whole workspace editable (idempotent)
#   make demo    run recipes/demo.yaml on the embedded stack
#   make test    setup + lint + proto check + the whole test suite, vLLM included (CI)
#   make lint    ruff lint + format check + mypy + import contracts (import-linter) + size check
#   make docs    regenerate docs/reference/ from the code, build the docs site (--strict)
#   make bench   the `treadle bench` workloads (JSON)
#   make nats-conf  rewrite deploy/nats/nats.conf and k8s/base/nats.conf (NATS users)
#   make seccomp-profile  rewrite deploy/seccomp/env-gateway.json (the gateway container's)
#   make lock    rewrite requirements/ (hashes) from what the venvs have installed (pip-tools)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Every third-party package comes from requirements/ci.txt, pinned with its hashes
# (`make lock` rewrites it and the images' parts from a working .venv); torch there is the
# CPU build. A different torch (CUDA) is an unpinned override, e.g.
#   make setup TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?=
SERVICES := weight-store env-gateway reward rollout trainer
LIBS := common cli
STAMP := $(VENV)/.treadle-installed
WORKSPACE := -e 'libs/common[hf]' -e 'libs/cli[hf,infra,report,gguf,trace]' -e bench -e sim -e conformance \
	$(foreach s,$(SERVICES),-e services/$(s)) -e 'services/trainer[trackers]' -e '.[dev]' -e 'services/env-gateway[verifiers]' \
	-e examples/verifiers/vf-tiny-arith -e examples/agents/arith-agent
PYTEST_ARGS ?=
# parallel pytest workers (pytest-xdist; a test file per unit, the Docker tests on one worker)
PYTEST_WORKERS ?= 2

.PHONY: setup demo test test-vllm lint docs bench protos nats-conf seccomp-profile lock clean

setup: $(STAMP)

# the lock installed with --no-deps: it is the whole closure (pip check proves it); resolving
# it again let pip 23's hash mode try an extra's bare name (tinker's httpx[http2]) against the
# index's newest release and refuse the install once one came out past the lock. Requires-Python
# is not judged again: megatron-core 0.17+ declares >= 3.12 yet ships the cp311 wheels CI tests
$(STAMP): requirements/ci.txt pyproject.toml examples/verifiers/vf-tiny-arith/pyproject.toml examples/agents/arith-agent/pyproject.toml $(foreach l,$(LIBS),libs/$(l)/pyproject.toml) bench/pyproject.toml sim/pyproject.toml conformance/pyproject.toml $(foreach s,$(SERVICES),services/$(s)/pyproject.toml)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --require-hashes --no-deps --ignore-requires-python -r requirements/ci.txt
	$(if $(TORCH_SPEC),$(PIP) install --quiet $(TORCH_SPEC))
	$(PIP) install --quiet --no-deps --no-build-isolation $(WORKSPACE)
	$(PIP) check  # the lock holds everything our packages ask for
	$(PY) scripts/install_kubectl.py $(VENV)  # kubectl + kustomize, for the k8s/ tests
	touch $@

demo: setup
	$(VENV)/bin/treadle run recipes/demo.yaml

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy $(wildcard libs/*/src/treadle_*) bench/src/treadle_bench sim/src/treadle_sim conformance/src/treadle_conformance $(wildcard services/*/src/treadle_*)
	$(VENV)/bin/lint-imports  # the layering contracts in pyproject.toml
	$(PY) scripts/check_sizes.py  # no function over 60 lines, no class over 400

# the docs site: reference pages generated from the code, then mkdocs (material) --strict
docs: setup
	$(PY) scripts/gen_docs.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

protos: setup
	$(PY) scripts/gen_protos.py

nats-conf: setup
	$(PY) scripts/gen_nats_conf.py

seccomp-profile: setup
	$(PY) scripts/gen_seccomp_profile.py

# A changed dependency (a pyproject, a spec in setup_*.sh): the venvs resolve it unpinned
# first (async-timeout: what redis needs on an image's older Python 3.11), then are locked.
# pip-tools lives in a venv of its own, so it is not in what it locks.
lock:
	test -x .venv-lock/bin/pip-compile || (python3 -m venv .venv-lock && .venv-lock/bin/pip install --quiet pip-tools)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet hatchling editables async-timeout $(WORKSPACE)
	$(PY) scripts/lock.py --pip-compile .venv-lock/bin/pip-compile
	TREADLE_UNLOCKED=1 scripts/setup_cookbook.sh && $(PY) scripts/lock.py --venv .venv-cookbook \
		--out requirements/cookbook.txt --pip-compile .venv-lock/bin/pip-compile
	TREADLE_UNLOCKED=1 scripts/setup_verifiers.sh && $(PY) scripts/lock.py --venv .venv-verifiers \
		--out requirements/verifiers.txt --pip-compile .venv-lock/bin/pip-compile
	TREADLE_UNLOCKED=1 scripts/setup_vllm.sh && $(PY) scripts/lock.py --venv .venv-vllm \
		--out requirements/vllm.txt --pip-compile .venv-lock/bin/pip-compile \
		--without torchvision,torchaudio,torchcodec

test: lint
	$(PY) scripts/gen_protos.py --check
	$(PY) scripts/gen_docs.py --check  # the reference pages match the code
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	scripts/setup_cookbook.sh  # the Tinker Cookbook, a client in its own venv (its test)
	scripts/setup_verifiers.sh  # verifiers 0.4, the verifiers-v1 env's workers' own venv
	@# vLLM's venv builds (pip: mostly download and unpack) while the suite runs
	scripts/setup_vllm.sh > $(VENV)/vllm-setup.log 2>&1 & setup=$$!; \
	$(PY) scripts/run_pytest.py -n $(PYTEST_WORKERS) --no-loadscope-reorder -m 'not vllm' $(PYTEST_ARGS); \
	rc=$$?; wait $$setup || { cat $(VENV)/vllm-setup.log; exit 1; }; exit $$rc
	$(MAKE) test-vllm

# the vLLM engine, for real on CPU, in its own venv (scripts/setup_vllm.sh builds it)
test-vllm: setup
	scripts/setup_vllm.sh
	.venv-vllm/bin/python scripts/run_pytest.py tests/vllm -m vllm -p no:cacheprovider
	@# a stack with rollout in .venv-vllm and the other services in .venv
	$(PY) scripts/run_pytest.py tests/e2e/test_vllm_stack.py -m vllm -p no:cacheprovider

bench: setup
	$(VENV)/bin/treadle bench weights --json
	$(VENV)/bin/treadle bench env --json
	$(VENV)/bin/treadle bench reward --json
	$(VENV)/bin/treadle bench rollout --json

clean:
	rm -rf $(VENV) .venv-vllm .venv-cookbook .venv-verifiers .venv-lock .treadle .site
