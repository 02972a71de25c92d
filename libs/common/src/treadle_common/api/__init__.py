"""The HTTP APIs' models, shared by the services that answer with them and the clients that
read them (`treadle_common.clients`, the `treadle` CLI): a field renamed on one side is a
type error on the other, not a `KeyError` at run time.

    ops       every service: `/readyz`, `/v1/info`'s common part, stage progress
    runs      trainer: `/v1/runs` (RunStatus, StepRecord), `/v1/runs/{id}/evaluations`
    rollout   rollout: `/v1/info` (RolloutInfo), `/v1/evaluate`, `/v1/swaps`
    training  trainer: the Tinker-style `/v1/training/sessions` API
    weights   weight-store: `/v1/models`, `/v1/models/{model}/versions`
    envs      env-gateway: `/v1/envs`, `/v1/sessions`
    reward    reward: `/v1/score`, `/v1/score:batch`
"""
