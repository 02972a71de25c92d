"""The Tinker suite: behaviours of a Tinker API server that training code relies on, checked
through the official `tinker` SDK (as users drive it) and, where the SDK hides the wire
(a retried request, an unknown future, a missing key), over plain HTTP.

The checks train LoRA adapters of `rank` on the server's base model with a few token ids
under 40 (any vocabulary has them), so they run against a tiny random model as well as a
real one. Values are checked where they are known whatever the weights are: a loss at
on-policy inputs (every ratio 1), a new adapter scoring like the base model, a checkpoint
scoring like what was saved. The server's clients are made once and shared in order
(`TinkerServer.client`); `--only` still works, each check makes what it needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import tinker
from tinker import types

from treadle_conformance.report import Suite, expect

TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]
PROMPT_LEN = 3
ADAM = types.AdamParams(learning_rate=5e-3)
REL = 1e-4


def sft_datum(tokens: list[int], prompt_len: int) -> types.Datum:
    """Predict tokens[1:] from tokens[:-1]; only the completion carries weight."""
    weights = [0.0] * (prompt_len - 1) + [1.0] * (len(tokens) - prompt_len)
    inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": weights}  # SDK converts
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


DATA = [sft_datum(TOKENS, PROMPT_LEN)]


@dataclass
class TinkerServer:
    """The server under test, and the SDK clients the checks share."""

    url: str
    api_key: str
    base_model: str | None = None
    """The base model to train on (default: the first the server lists)."""
    rank: int = 4
    service: Any = None
    clients: dict[str, Any] = field(default_factory=dict)
    snapshots: dict[str, list[float]] = field(default_factory=dict)
    """Logprobs of `DATA` recorded by one check for a later one."""

    def sdk(self) -> tinker.ServiceClient:
        if self.service is None:
            self.service = tinker.ServiceClient(base_url=self.url, api_key=self.api_key)
        return self.service

    def capabilities(self) -> types.GetServerCapabilitiesResponse:
        return self.sdk().create_rest_client().get_server_capabilities().result()

    def model(self) -> str:
        if self.base_model is None:
            models = self.capabilities().supported_models
            expect(models and models[0].model_name, "the server lists no base models")
            self.base_model = str(models[0].model_name)
        return self.base_model

    def client(self, name: str) -> Any:
        """The LoRA training client `name` (made on first use, seeded by its name)."""
        if name not in self.clients:
            seed = sum(map(ord, name))
            future = self.sdk().create_lora_training_client(self.model(), self.rank, seed=seed)
            self.clients[name] = future.result()
        return self.clients[name]

    def http(self, key: str | None = None) -> httpx.Client:
        """Plain HTTP to the API (`/api/v1`), with the key unless `key` says otherwise."""
        headers = {"X-API-Key": self.api_key if key is None else key}
        return httpx.Client(base_url=f"{self.url}/api/v1", headers=headers, timeout=60)

    def close(self) -> None:
        if self.service is not None:
            self.service.close("success").result()


suite: Suite[TinkerServer] = Suite("tinker")


def logprobs(client: Any, data: list[types.Datum] = DATA) -> list[float]:
    out = client.forward(data, "cross_entropy").result()
    return [lp for o in out.loss_fn_outputs for lp in o["logprobs"].tolist()]


def close(a: list[float], b: list[float], rel: float = REL, abs_: float = 1e-5) -> bool:
    return len(a) == len(b) and all(
        abs(x - y) <= max(abs_, rel * max(abs(x), abs(y))) for x, y in zip(a, b, strict=True)
    )


def rl_datum(lps: list[float], advantages: list[float]) -> types.Datum:
    inputs: dict[str, Any] = {
        "target_tokens": TOKENS[1:],
        "logprobs": lps,
        "advantages": advantages,
    }
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs=inputs)


ADVANTAGES = [0.0, 1.0, 1.0, -1.0, 1.0, 0.5, -0.5]


# --- setup ------------------------------------------------------------------------------------
@suite.check("capabilities.models", "`get_server_capabilities` lists the base models served")
def capabilities(t: TinkerServer) -> None:
    names = [m.model_name for m in t.capabilities().supported_models]
    expect(t.model() in names, f"{t.model()!r} is not in {names}")


@suite.check(
    "training.create_lora",
    "`create_lora_training_client` makes a client with its own model id, and `get_info` "
    "reports a LoRA of that rank on that base model",
)
def create_lora(t: TinkerServer) -> None:
    a, b = t.client("a"), t.client("b")
    expect(a.model_id != b.model_id, "two clients share a model id")
    info = a.get_info()
    expect(info.is_lora and info.lora_rank == t.rank, f"is_lora {info.is_lora}, rank {info}")
    expect(info.model_data.model_name == t.model(), f"base {info.model_data.model_name!r}")


@suite.check(
    "lora.new_is_base",
    "A new adapter scores exactly like the base model: two new clients agree on every logprob",
)
def new_is_base(t: TinkerServer) -> None:
    a, b = logprobs(t.client("a")), logprobs(t.client("b"))
    expect(len(a) == len(TOKENS) - 1, f"{len(a)} logprobs for {len(TOKENS) - 1} targets")
    expect(close(a, b), f"{a} != {b}")
    t.snapshots["base"] = b


# --- losses at known inputs ---------------------------------------------------------------------
@suite.check(
    "loss.cross_entropy",
    "`cross_entropy`: `loss:sum` is minus the weighted sum of the returned logprobs, each <= 0",
)
def loss_cross_entropy(t: TinkerServer) -> None:
    out = t.client("b").forward(DATA, "cross_entropy").result()
    lps = out.loss_fn_outputs[0]["logprobs"].tolist()
    weights = DATA[0].loss_fn_inputs["weights"].tolist()
    want = -sum(lp * w for lp, w in zip(lps, weights, strict=True))
    expect(all(lp <= 0 for lp in lps), f"a logprob > 0: {lps}")
    expect(close([out.metrics["loss:sum"]], [want]), f"loss:sum {out.metrics} != {want}")


def on_policy_loss(t: TinkerServer, loss: str) -> tuple[float, list[float]]:
    client = t.client("b")
    lps = logprobs(client)
    out = client.forward([rl_datum(lps, ADVANTAGES)], loss).result()
    return out.metrics["loss:sum"], lps


@suite.check(
    "loss.importance_sampling",
    "`importance_sampling` at on-policy logprobs (every ratio 1): `loss:sum` is -sum(A)",
)
def loss_importance_sampling(t: TinkerServer) -> None:
    got, _ = on_policy_loss(t, "importance_sampling")
    expect(close([got], [-sum(ADVANTAGES)]), f"loss:sum {got} != {-sum(ADVANTAGES)}")


@suite.check("loss.ppo", "`ppo` at on-policy logprobs (no clipping): `loss:sum` is -sum(A)")
def loss_ppo(t: TinkerServer) -> None:
    got, _ = on_policy_loss(t, "ppo")
    expect(close([got], [-sum(ADVANTAGES)]), f"loss:sum {got} != {-sum(ADVANTAGES)}")


@suite.check(
    "loss.cispo",
    "`cispo` at on-policy logprobs (the ratio a stop-gradient weight of 1): `loss:sum` is "
    "-sum(A * logprob)",
)
def loss_cispo(t: TinkerServer) -> None:
    got, lps = on_policy_loss(t, "cispo")
    want = -sum(a * lp for a, lp in zip(ADVANTAGES, lps, strict=True))
    expect(close([got], [want]), f"loss:sum {got} != {want}")


# --- futures ------------------------------------------------------------------------------------
@suite.check(
    "futures.ordered",
    "Requests submitted without waiting run in order: a forward queued after "
    "forward_backward and optim_step sees the stepped weights",
)
def futures_ordered(t: TinkerServer) -> None:
    a = t.client("a")
    before = logprobs(a)
    fb = a.forward_backward(DATA, "cross_entropy")
    step = a.optim_step(ADAM)
    queued = a.forward(DATA, "cross_entropy")
    expect(step.result().metrics is not None, "optim_step returned no metrics")
    fb.result()
    seen = [lp for o in queued.result().loss_fn_outputs for lp in o["logprobs"].tolist()]
    after = logprobs(a)
    expect(close(seen, after), f"the queued forward {seen} is not the stepped model {after}")
    expect(not close(before, after), "optim_step did not change the adapter")
    expect(sum(after) > sum(before), f"one step of SFT did not raise the logprobs: {after}")


def retrieve(http: httpx.Client, request_id: str, timeout_s: float = 120.0) -> dict:
    """A future's JSON result, asking again while the server says try again."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = http.post("/retrieve_future", json={"request_id": request_id})
        expect(response.status_code == 200, f"retrieve_future: HTTP {response.status_code}")
        body = response.json()
        if body.get("type") != "try_again":
            return body
        expect(time.monotonic() < deadline, f"{request_id} did not finish in {timeout_s} s")
        time.sleep(0.1)  # a server that answers try_again at once is not asked in a tight loop


@suite.check(
    "futures.retry_same_seq_id",
    "A request re-sent with the same model and seq_id (a retry whose answer was lost) gets "
    "the first one's request id and result; the next seq_id is a new request",
)
def retry_same_seq_id(t: TinkerServer) -> None:
    r = t.client("r")
    with t.http() as http:

        def submit(seq_id: int) -> str:
            request = types.OptimStepRequest(optim_params=ADAM, model_id=r.model_id, seq_id=seq_id)
            body = request.model_dump(mode="json", exclude_none=True)
            response = http.post("/optim_step", json=body)
            expect(response.status_code == 200, f"optim_step: HTTP {response.status_code}")
            return response.json()["request_id"]

        first, again = submit(1), submit(1)
        expect(first == again, f"the retry got a new request id: {first} != {again}")
        expect(retrieve(http, first) == retrieve(http, again), "the two answers differ")
        expect(submit(2) != first, "seq_id 2 got seq_id 1's request id")


# --- adapters, checkpoints ----------------------------------------------------------------------
@suite.check(
    "lora.isolation",
    "Training one client's adapter leaves another's on the same base model exactly as it was",
)
def lora_isolation(t: TinkerServer) -> None:
    a, b = t.client("a"), t.client("b")
    untouched = logprobs(b)
    for _ in range(2):
        a.forward_backward(DATA, "cross_entropy")
        a.optim_step(ADAM).result()
    expect(close(logprobs(b), untouched, rel=1e-6), "b moved while a trained")


@suite.check(
    "checkpoint.state",
    "`save_state` returns a `tinker://` path; a client made from it scores exactly like the "
    "saved one",
)
def checkpoint_state(t: TinkerServer) -> None:
    a = t.client("a")
    path = a.save_state("conformance").result().path
    expect(path.startswith("tinker://"), f"path {path!r}")
    restored = t.sdk().create_training_client_from_state(path).result()
    expect(close(logprobs(restored), logprobs(a), rel=1e-6), "the restored client differs")


@suite.check(
    "checkpoint.optimizer",
    "A client made from a state with its optimizer takes the same next step as the original",
)
def checkpoint_optimizer(t: TinkerServer) -> None:
    a = t.client("a")
    path = a.save_state("conformance-opt").result().path
    restored = t.sdk().create_training_client_from_state_with_optimizer(path).result()
    for client in (a, restored):
        client.forward_backward(DATA, "cross_entropy")
        client.optim_step(ADAM).result()
    expect(close(logprobs(restored), logprobs(a)), "the next steps differ")


# --- sampling -----------------------------------------------------------------------------------
@suite.check(
    "sampling.logprobs",
    "A sampling client of a trained adapter returns at most max_tokens tokens with one "
    "logprob each, matching the trainer's logprobs of those tokens within 0.01",
)
def sampling_logprobs(t: TinkerServer) -> None:
    a = t.client("a")
    sampler = a.save_weights_and_get_sampling_client().result()
    prompt = TOKENS[:PROMPT_LEN]
    params = types.SamplingParams(max_tokens=5, seed=3)
    [seq] = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences
    expect(1 <= len(seq.tokens) <= 5, f"{len(seq.tokens)} tokens for max_tokens 5")
    expect(seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens), "logprobs")
    trained = logprobs(a, [sft_datum(prompt + seq.tokens, PROMPT_LEN)])[PROMPT_LEN - 1 :]
    expect(close(trained, seq.logprobs, rel=0, abs_=1e-2), f"{trained} != {seq.logprobs}")


@suite.check(
    "sampling.num_samples",
    "`num_samples: n` returns n sequences, each ending with stop reason `length` or `stop`",
)
def sampling_num_samples(t: TinkerServer) -> None:
    sampler = t.sdk().create_sampling_client(base_model=t.model()).result()
    params = types.SamplingParams(max_tokens=4, seed=5)
    out = sampler.sample(types.ModelInput.from_ints(TOKENS[:PROMPT_LEN]), 3, params).result()
    expect(len(out.sequences) == 3, f"{len(out.sequences)} sequences, not 3")
    for seq in out.sequences:
        expect(len(seq.tokens) <= 4, f"{len(seq.tokens)} tokens for max_tokens 4")
        expect(seq.stop_reason in ("length", "stop"), f"stop reason {seq.stop_reason!r}")


# --- errors -------------------------------------------------------------------------------------
@suite.check(
    "errors.unknown_base_model",
    "A training client on a base model the server does not serve is refused with an error",
)
def unknown_base_model(t: TinkerServer) -> None:
    try:
        t.sdk().create_lora_training_client("no-such-base-model", t.rank).result()
    except (tinker.APIStatusError, tinker.RequestFailedError) as exc:
        status = getattr(exc, "status_code", 400)
        expect(400 <= status < 500, f"HTTP {status}: a server error, not a refusal")
        return
    expect(False, "a client was made on a base model the server does not serve")


@suite.check(
    "errors.bad_tokens",
    "A forward_backward with a token id outside the vocabulary fails as the caller's error "
    "(`RequestFailedError`), and the client trains on afterwards",
)
def bad_tokens(t: TinkerServer) -> None:
    b = t.client("b")
    try:
        b.forward_backward([sft_datum([5, 6, 10**9, 7], 2)], "cross_entropy").result()
    except tinker.RequestFailedError:
        b.forward(DATA, "cross_entropy").result()
        return
    expect(False, "a token id of 10**9 was accepted")


@suite.check("errors.unknown_future", "`retrieve_future` of an unknown request id is a 404")
def unknown_future(t: TinkerServer) -> None:
    with t.http() as http:
        response = http.post("/retrieve_future", json={"request_id": "no-such-request"})
    expect(response.status_code == 404, f"HTTP {response.status_code}")


@suite.check("auth.no_key", "A call without an API key, or with an unknown one, is a 401")
def auth_no_key(t: TinkerServer) -> None:
    for key in ("", "tml-not-a-key"):
        with t.http(key=key) as http:
            status = http.get("/get_server_capabilities").status_code
        expect(status == 401, f"key {key!r}: HTTP {status}")
