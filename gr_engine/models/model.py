"""The engine's ranking model: embeddings, HSTU (or SASRec-style) layers, ranking and retrieval heads.

Its cache-consistency invariants (prefix and batch invariance) are docs/design.md section 4's. Candidates sit at
position ``n`` (the history length) with a learned "candidate" action; each attends to the whole history and itself
only. The model never sees the KV storage: each layer gets an ``attend(q, k, v)`` callable from the model runner
(paged, through an attention backend) or from :meth:`GRModel.forward_reference` (dense).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from attention_backends.base import time_bucket

from ..config import ModelConfig
from .layers import AttendFn, FusedLayerNorm, HSTULayer, SASRecLayer


class GRModel(nn.Module):
    """Embeddings, ``num_layers`` layers (``config.architecture``), a multi-task ranking head and a
    retrieval head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.item_embedding = nn.Embedding(config.num_items, d)
        self.action_embedding = nn.Embedding(config.num_actions + 1, d)  # last row: candidates
        self.position_embedding = nn.Embedding(config.max_history_len + 1, d)
        layer = HSTULayer if config.architecture == "hstu" else SASRecLayer
        self.layers = nn.ModuleList(layer(config) for _ in range(config.num_layers))
        self.final_norm = FusedLayerNorm(d, eps=1e-6)  # one Triton kernel on CUDA
        self.ranking_head = nn.Sequential(
            nn.Linear(d, config.ranking_hidden), nn.SiLU(), nn.Linear(config.ranking_hidden, config.num_tasks)
        )
        self.reset_parameters(config.seed)

    @property
    def candidate_action(self) -> int:
        """The action id a candidate's token carries (``num_actions``: one past the real actions)."""
        return self.config.num_actions

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic random init from ``seed`` (independent of torch's global RNG)."""
        gen = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                fan_in = module.weight.shape[1]
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * fan_in**-0.5)
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * 0.02)
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.5)
            elif isinstance(module, (HSTULayer, SASRecLayer)) and module.time_bias is not None:
                module.time_bias.copy_(torch.randn(module.time_bias.shape, generator=gen) * 0.5)
            if isinstance(module, nn.LayerNorm):
                module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=gen))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))

    # ------------------------------------------------------------------ building blocks
    def embed(self, item_ids: torch.Tensor, action_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token inputs. Args: int ``[T]`` each. Returns ``[T, d_model]``."""
        return (self.item_embedding(item_ids) + self.action_embedding(action_ids)
                + self.position_embedding(positions))

    def encode(self, x: torch.Tensor, attends: Sequence[AttendFn]) -> torch.Tensor:
        """Run the layers (layer ``l`` uses ``attends[l]``) and the final norm. ``[T, d]`` -> ``[T, d]``."""
        for layer, attend in zip(self.layers, attends, strict=True):
            x = layer(x, attend)
        return self.final_norm(x)

    def rank_logits(self, candidate_states: torch.Tensor) -> torch.Tensor:
        """Ranking head. ``[C, d]`` final states of candidates -> ``[C, num_tasks]`` logits."""
        return self.ranking_head(candidate_states)

    def retrieval_scores(self, history_states: torch.Tensor) -> torch.Tensor:
        """Retrieval head. ``[B, d]`` final state of each user's last event -> ``[B, num_items]``."""
        return history_states @ self.item_embedding.weight.T

    # ------------------------------------------------------------------ oracle
    @torch.no_grad()
    def forward_reference(
        self, item_ids: torch.Tensor, action_ids: torch.Tensor, candidate_ids: torch.Tensor,
        timestamps: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One request, whole sequence, dense attention, no cache: the oracle for tests.

        Args:
            item_ids, action_ids: int64 ``[n]`` history.
            candidate_ids: int64 ``[c]`` (may be empty).
            timestamps: int64 ``[n]`` event times (needed with ``time_bias_buckets``).

        Returns:
            ``(logits [c, num_tasks], last_history_state [d] or None when n == 0)``.
        """
        n, c = len(item_ids), len(candidate_ids)
        device = self.item_embedding.weight.device
        items = torch.cat([item_ids.long(), candidate_ids.long()]).to(device)
        actions = torch.cat([action_ids.long(), torch.full((c,), self.candidate_action)]).to(device)
        positions = torch.cat([torch.arange(n), torch.full((c,), n)]).to(device)
        idx = torch.arange(n + c, device=device)
        history_key = idx[None, :] < n
        mask = (history_key & (idx[None, :] <= idx[:, None])) | (idx[None, :] == idx[:, None])
        alpha, inv_n = self.config.alpha, 1.0 / self.config.normaliser

        softmax = self.config.attention_kind == "softmax"
        buckets = None
        if self.config.time_bias_buckets:
            if timestamps is None:
                raise ValueError("this model has a relative time bias: pass the timestamps")
            times = timestamps.long()
            times = torch.cat([times, times[-1:].expand(c) if n else torch.zeros(c, dtype=torch.long)]).to(device)
            buckets = time_bucket(times[:, None] - times[None, :], self.config.time_bias_buckets)

        def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, time_bias: torch.Tensor | None) -> torch.Tensor:
            logits = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * alpha
            if time_bias is not None:
                logits = logits + time_bias.float()[buckets].permute(2, 0, 1)
            if softmax:
                weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
            else:
                weights = torch.where(mask, F.silu(logits), 0.0) * inv_n
            return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)

        states = self.encode(self.embed(items, actions, positions), [dense] * len(self.layers))
        return self.rank_logits(states[n:]), (states[n - 1] if n else None)

    # ------------------------------------------------------------------ weights
    def save(self, path: str | Path) -> None:
        """Write the weights (and the model config, as metadata) to a safetensors file."""
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        config = json.dumps({f: getattr(self.config, f) for f in self.config.__struct_fields__})
        save_file(tensors, str(path), metadata={"gr_engine.model_config": config})

    def load(self, path: str | Path) -> None:
        """Read weights written by :meth:`save`; shapes must match this model's config.

        Raises:
            ValueError: a file that is not safetensors; missing, unexpected or wrongly shaped tensors (the message
                lists them).
        """
        if not Path(path).is_file():
            raise FileNotFoundError(f"weights file {path} does not exist")
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # safetensors' own error type: a file that is not safetensors
            raise ValueError(f"cannot read weights file {path} as safetensors: {exc}") from exc
        own = self.state_dict()
        missing = sorted(set(own) - set(tensors))
        unexpected = sorted(set(tensors) - set(own))
        wrong = sorted(k for k in set(own) & set(tensors) if own[k].shape != tensors[k].shape)
        if missing or unexpected or wrong:
            raise ValueError(
                f"weights in {path} do not fit this model config: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
            )
        self.load_state_dict(tensors)
