"""The official Tinker SDK (`tinker`, pinned by the trainer's dependencies) against a real
trainer + weight-store: LoRA training clients on one shared base model."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.support.services import ADMIN, TOKENS, ServiceProc, start_service  # noqa: E402
from tests.support.tinker_stack import tinker_stack  # noqa: E402

SDK_VERSION = "0.38.0"


@pytest.fixture
def stack(infra, tmp_path, tiny_model, monkeypatch):
    """weight-store, env-gateway, rollout serving the tiny model as `tiny`, and a trainer
    whose Tinker API trains on it and samples through that rollout."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker_stack(infra, tmp_path, tiny_model) as procs:
        try:
            yield procs
        finally:
            # the test's SDK clients close while the stack runs: an open one heartbeats its
            # session from a thread, and logs the failures long after the stack is gone
            while _OPEN:
                _OPEN.pop().close("success").result()


_OPEN: list[tinker.ServiceClient] = []
"""SDK clients `service_client` made; `stack` closes them."""


def service_client(trainer: ServiceProc, token: str | None = None) -> tinker.ServiceClient:
    client = tinker.ServiceClient(
        base_url=trainer.http, api_key="tml-" + (token or TOKENS["trainer"])
    )
    _OPEN.append(client)
    return client


def sft_datum(tokens: list[int], prompt_len: int) -> types.Datum:
    """Predict tokens[1:] from tokens[:-1]; only the completion carries weight."""
    weights = [0.0] * (prompt_len - 1) + [1.0] * (len(tokens) - prompt_len)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def mean_nll(client, data) -> float:
    out = client.forward(data, "cross_entropy").result()
    total = 0.0
    for o, d in zip(out.loss_fn_outputs, data, strict=True):
        weights = d.loss_fn_inputs["weights"].tolist()
        total -= sum(lp * w for lp, w in zip(o["logprobs"].tolist(), weights, strict=True))
    return total / sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)


def test_sdk_version_is_the_pinned_one():
    assert tinker.__version__ == SDK_VERSION


def test_lora_sft_through_the_sdk(stack, tmp_path):
    trainer, store, _ = stack
    sc = service_client(trainer)
    caps = httpx.get(f"{trainer.http}/api/v1/get_server_capabilities", headers=ADMIN).json()
    assert [(m["model_name"], m["sampleable"]) for m in caps["supported_models"]] == [
        ("tiny", True)
    ]

    a = sc.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    b = sc.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
    assert a.model_id != b.model_id
    info = a.get_info()
    assert info.is_lora and info.lora_rank == 8 and info.model_data.model_name == "tiny"
    tokenizer = a.get_tokenizer()  # the SDK loads it from get_info's tokenizer_id
    assert tokenizer.vocab_size > 0

    data_a = [sft_datum([5, 6, 7, 8, 9, 10, 11, 12], 3), sft_datum([5, 6, 7, 13, 14, 15], 3)]
    data_b = [sft_datum([20, 21, 22, 30, 31, 32, 33], 3)]
    base_a, base_b = mean_nll(a, data_a), mean_nll(b, data_b)
    # a new adapter is the base model exactly (B = 0): both clients agree with each other
    assert mean_nll(b, data_a) == pytest.approx(base_a, rel=1e-5)

    losses = []
    for _ in range(8):
        fb = a.forward_backward(data_a, "cross_entropy")
        step = a.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fb.result().metrics["loss:sum"])
        assert step.result().metrics["grad_norm"] > 0
    assert losses[-1] < 0.5 * losses[0], losses
    assert mean_nll(a, data_a) < 0.5 * base_a
    # b shares the base model but not a's adapter: it still scores like the base model
    assert mean_nll(b, data_a) == pytest.approx(base_a, rel=1e-5)
    assert mean_nll(b, data_b) == pytest.approx(base_b, rel=1e-5)

    # b trains on its own data; a's results do not move
    after_a = mean_nll(a, data_a)
    for _ in range(3):
        b.forward_backward(data_b, "cross_entropy")
        b.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert mean_nll(b, data_b) < base_b
    assert mean_nll(a, data_a) == pytest.approx(after_a, rel=1e-6)

    # save_state -> a new client from that state scores exactly like a; with the optimizer
    # its next step matches a's next step
    saved = a.save_state("ckpt").result().path
    assert saved.startswith(f"tinker://{a.model_id}/weights/ckpt")
    c = sc.create_training_client_from_state_with_optimizer(saved).result()
    assert mean_nll(c, data_a) == pytest.approx(after_a, rel=1e-6)
    for client in (a, c):
        client.forward_backward(data_a, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert mean_nll(c, data_a) == pytest.approx(mean_nll(a, data_a), rel=1e-5)

    # sampler weights: the adapter only, published as a weight-store version
    sampler_path = a.save_weights_for_sampler("s1").result().path
    assert sampler_path == f"tinker://{a.model_id}/sampler_weights/s1"
    store_model = "tinker-" + a.model_id.replace(":", "-")
    assert store_model in httpx.get(f"{store.http}/v1/models", headers=ADMIN).json()["models"]
    manifest = httpx.get(f"{store.http}/v1/models/{store_model}/versions/-1", headers=ADMIN)
    names = [t["name"] for t in manifest.json()["tensors"]]
    assert names and all(n.endswith((".lora_A", ".lora_B")) for n in names), names[:4]


def test_rl_losses_and_their_errors(stack):
    trainer, _, _ = stack
    sc = service_client(trainer)
    client = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    tokens = [5, 6, 7, 8, 9, 10]
    for loss in ("importance_sampling", "ppo", "cispo"):
        forward = client.forward([sft_datum(tokens, 2)], "cross_entropy").result()
        logprobs = forward.loss_fn_outputs[0]["logprobs"].tolist()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": tokens[1:],
                "logprobs": logprobs,  # on-policy: every ratio is 1
                "advantages": [0.0, 1.0, 1.0, -1.0, 1.0],
            },
        )
        out = client.forward_backward([datum], loss).result()
        # at ratio 1: importance_sampling and ppo are -sum(A) (weight 1, no clipping);
        # cispo is -sum(A logp) (the ratio is a stop-gradient weight)
        advantages = datum.loss_fn_inputs["advantages"].tolist()
        want = -sum(advantages)
        if loss == "cispo":
            want = -sum(a * lp for a, lp in zip(advantages, logprobs, strict=True))
        assert out.metrics["loss:sum"] == pytest.approx(want, abs=1e-4), loss
        assert out.metrics["log_ratio_abs_mean:mean"] == pytest.approx(0.0, abs=1e-4), loss
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    # sampled by an engine whose logprobs were 0.5 lower: the drift says so
    forward = client.forward([sft_datum(tokens, 2)], "cross_entropy").result()
    lower = [lp - 0.5 for lp in forward.loss_fn_outputs[0]["logprobs"].tolist()]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": lower, "advantages": [1.0] * 5},
    )
    drift = client.forward_backward([datum], "importance_sampling").result().metrics
    assert drift["log_ratio_mean:mean"] == pytest.approx(0.5, abs=1e-4)
    assert drift["log_ratio_max:max"] == pytest.approx(0.5, abs=1e-4)
    assert drift["behaviour_kl:mean"] == pytest.approx(math.expm1(0.5) - 0.5, abs=1e-4)

    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_inputs"):
        client.forward_backward([sft_datum(tokens, 2)], "ppo").result()
    with pytest.raises(tinker.RequestFailedError, match="token ids must be in"):
        bad = sft_datum([5, 6, 10**6, 7], 2)
        client.forward_backward([bad], "cross_entropy").result()
    with pytest.raises(tinker.APIStatusError, match="not served here"):
        sc.create_lora_training_client(base_model="nope", rank=4).result()


def test_auth_and_limits(stack):
    trainer, _, _ = stack
    # no key / a wrong key / a role that may not train
    assert httpx.get(f"{trainer.http}/api/v1/get_server_capabilities").status_code == 401
    wrong = {"X-API-Key": "tml-not-a-token"}
    assert (
        httpx.get(f"{trainer.http}/api/v1/get_server_capabilities", headers=wrong).status_code
        == 401
    )
    agent = {"X-API-Key": "tml-" + TOKENS["agent"]}
    assert (
        httpx.get(f"{trainer.http}/api/v1/get_server_capabilities", headers=agent).status_code
        == 403
    )
    # a forward_backward that is not protobuf, and an unknown future: clear 4xx, service stays up
    key = {"X-API-Key": "tml-" + TOKENS["trainer"]}
    r = httpx.post(
        f"{trainer.http}/api/v1/forward_backward", content=b"\xff\x00garbage", headers=key
    )
    assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["detail"]
    r = httpx.post(f"{trainer.http}/api/v1/retrieve_future", json={"request_id": "x"}, headers=key)
    assert r.status_code == 404
    # at most TREADLE_TRAINER_TINKER_MAX_CLIENTS (3) clients
    sc = service_client(trainer)
    for _ in range(3):
        sc.create_lora_training_client(base_model="tiny", rank=2).result()
    # one more is refused with 429 (the SDK would back off and retry: capacity may free up)
    session = httpx.post(
        f"{trainer.http}/api/v1/create_session",
        json={"tags": [], "user_metadata": None, "sdk_version": SDK_VERSION},
        headers=key,
    ).json()["session_id"]
    body = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": "tiny",
        "lora_config": {"rank": 2},
    }
    r = httpx.post(f"{trainer.http}/api/v1/create_model", json=body, headers=key)
    assert r.status_code == 429 and "most this trainer holds" in r.json()["detail"]
    assert httpx.get(f"{trainer.http}/readyz").status_code == 200


def test_sampling_from_trained_adapters_through_rollout(stack):
    trainer, _, rollout = stack
    sc = service_client(trainer)
    a = sc.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    b = sc.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
    prompt, completion = [5, 6, 7], [40, 41, 42, 43]
    data = [sft_datum(prompt + completion, len(prompt))]
    for _ in range(200):
        a.forward_backward(data, "cross_entropy")
        a.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        if mean_nll(a, data) < 0.02:
            break
    assert mean_nll(a, data) < 0.02

    greedy = types.SamplingParams(max_tokens=len(completion), temperature=0.0)
    model_input = types.ModelInput.from_ints(prompt)
    trained = a.save_weights_and_get_sampling_client().result()
    untrained = b.save_weights_and_get_sampling_client().result()
    base = sc.create_sampling_client(base_model="tiny").result()

    got = trained.sample(model_input, 1, greedy).result().sequences[0]
    assert got.tokens == completion  # the adapter's behaviour, not the base model's
    base_tokens = base.sample(model_input, 1, greedy).result().sequences[0].tokens
    assert base_tokens != completion
    # b's adapter is untouched by a's training: it samples like the base model
    assert untrained.sample(model_input, 1, greedy).result().sequences[0].tokens == base_tokens

    # num_samples, and behaviour logprobs that match the trainer's for the same tokens
    out = trained.sample(model_input, 4, types.SamplingParams(max_tokens=6, seed=3)).result()
    assert len(out.sequences) == 4 and len({s.sequence_id for s in out.sequences}) == 4
    for seq in out.sequences:
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        tokens = prompt + seq.tokens
        datum = sft_datum(tokens, len(prompt))
        forward = a.forward([datum], "cross_entropy").result().loss_fn_outputs[0]
        trainer_logprobs = forward["logprobs"].tolist()[len(prompt) - 1 :]
        assert trainer_logprobs == pytest.approx(seq.logprobs, abs=1e-4)

    # a named sampler checkpoint samples the same way, also from a new sampling client
    path = a.save_weights_for_sampler("final").result().path
    from_path = sc.create_sampling_client(model_path=path).result()
    again = from_path.sample(model_input, 1, greedy).result()
    assert again.sequences[0].tokens == completion
    served = httpx.get(f"{rollout.http}/v1/adapters", headers=ADMIN).json()["adapters"]
    assert len(served) >= 2 and all(n.startswith("tinker-") for n in served)

    # what is not served is refused, never ignored
    with pytest.raises(tinker.APIStatusError, match="prompt_logprobs"):
        trained.sample(model_input, 1, greedy, include_prompt_logprobs=True).result()


def test_rollout_adapter_api_refuses_what_it_cannot_serve(stack):
    trainer, store, rollout = stack
    url = f"{rollout.http}/v1/adapters"
    trainer_key = {"Authorization": f"Bearer {TOKENS['trainer']}"}
    missing = {"name": "x", "model": "no-such-model", "version": 1}
    r = httpx.post(url, json=missing, headers=trainer_key)
    assert r.status_code == 404 and "no-such-model" in r.json()["detail"]
    r = httpx.post(url, json={**missing, "name": "tiny"}, headers=trainer_key)
    assert r.status_code == 400 and "policy" in r.json()["detail"]
    r = httpx.post(url, json={"name": "../x", "model": "m", "version": 1}, headers=trainer_key)
    assert r.status_code == 422
    agent = {"Authorization": f"Bearer {TOKENS['agent']}"}
    assert httpx.post(url, json=missing, headers=agent).status_code == 403
    assert httpx.delete(f"{url}/nope", headers=trainer_key).status_code == 404
    # a full-weight version is not an adapter
    sc = service_client(trainer)
    client = sc.create_lora_training_client(base_model="tiny", rank=2).result()
    client.save_weights_for_sampler("s").result()
    full = httpx.post(
        f"{trainer.http}/v1/training/sessions",
        json={
            "model_path": httpx.get(f"{rollout.http}/v1/info", headers=ADMIN).json()["model_dir"]
        },
        headers=ADMIN,
    )
    assert full.status_code == 201, full.text
    sid = full.json()["session_id"]
    version = httpx.post(
        f"{trainer.http}/v1/training/sessions/{sid}/save_weights", headers=ADMIN
    ).json()["version"]
    r = httpx.post(
        url, json={"name": "full", "model": "tiny", "version": version}, headers=trainer_key
    )
    assert r.status_code == 400 and "not a LoRA adapter" in r.json()["detail"]
    # batched completions: a prompt list, n each; choices in prompt-major order
    r = httpx.post(
        f"{rollout.http}/v1/completions",
        json={"model": "tiny", "prompt": [[5, 6], [7, 8, 9]], "n": 2, "max_tokens": 2},
        headers=ADMIN,
    )
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    assert r.json()["usage"]["prompt_tokens"] == 5


def test_a_session_without_heartbeats_expires_and_frees_its_clients(infra, tmp_path, tiny_model):
    (tmp_path / "ws").mkdir()
    store = start_service("weight-store", infra, tmp_path / "ws")
    trainer = start_service(
        "trainer",
        infra,
        tmp_path,
        TREADLE_WEIGHT_STORE_ADDR=store.grpc_addr or "",
        TREADLE_TRAINER_TINKER_MODELS=json.dumps({"tiny": str(tiny_model)}),
        TREADLE_TRAINER_TINKER_MAX_CLIENTS="1",
        TREADLE_TRAINER_TINKER_SESSION_TTL_S="11",
    )
    try:
        key = {"X-API-Key": "tml-" + TOKENS["trainer"]}
        body = {"tags": [], "user_metadata": None, "sdk_version": SDK_VERSION}

        def new_client(session: str) -> httpx.Response:
            model = {
                "session_id": session,
                "model_seq_id": 0,
                "base_model": "tiny",
                "lora_config": {"rank": 2},
            }
            return httpx.post(f"{trainer.http}/api/v1/create_model", json=model, headers=key)

        quiet = httpx.post(f"{trainer.http}/api/v1/create_session", json=body, headers=key)
        first = new_client(quiet.json()["session_id"])
        assert first.status_code == 200, first.text
        rid = first.json()["request_id"]
        done = httpx.post(
            f"{trainer.http}/api/v1/retrieve_future",
            json={"request_id": rid},
            headers=key,
            timeout=60,
        ).json()
        assert done["model_id"].startswith(quiet.json()["session_id"])
        other = httpx.post(f"{trainer.http}/api/v1/create_session", json=body, headers=key)
        assert new_client(other.json()["session_id"]).status_code == 429  # the one slot is used
        time.sleep(12)  # no heartbeat from the first session for longer than its TTL
        other = httpx.post(f"{trainer.http}/api/v1/create_session", json=body, headers=key)
        assert new_client(other.json()["session_id"]).status_code == 200
        beat = {"session_id": quiet.json()["session_id"]}
        gone = httpx.post(f"{trainer.http}/api/v1/session_heartbeat", json=beat, headers=key)
        assert gone.status_code == 410  # the SDK stops heartbeating a finished session
    finally:
        trainer.stop_checked()
        store.stop_checked()
