"""Single-process torch backend: the policy model, its optimizer and one training step."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle_trainer.batches import TensorBatch
from treadle_trainer.losses import LOSSES


class TorchPolicy:
    def __init__(self, model_dir: Path, lr: float, loss: str, seed: int, device: str | None = None):
        torch.manual_seed(seed)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(
            self.device
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.loss_fn = LOSSES[loss]
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id

    def token_logprobs(self, batch: TensorBatch) -> torch.Tensor:
        logits_B_T_V = self.model(
            input_ids=batch.input_ids_B_T.to(self.device),
            attention_mask=batch.attention_B_T.to(self.device),
        ).logits.float()
        targets = batch.targets_B_T.to(self.device)
        return torch.log_softmax(logits_B_T_V, dim=-1).gather(2, targets[..., None]).squeeze(-1)

    def train_step(self, batch: TensorBatch) -> dict[str, float]:
        self.model.train()
        logprobs_B_T = self.token_logprobs(batch)
        mask = batch.mask_B_T.to(self.device)
        loss = self.loss_fn(logprobs_B_T, batch.advantages_B.to(self.device), mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.model.eval()
        return {"loss": loss.item(), "grad_norm": grad_norm.item(), "num_tokens": mask.sum().item()}

    def state_dict_cpu(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu").contiguous() for k, v in self.model.state_dict().items()}
