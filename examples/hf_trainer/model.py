"""A random-initialised GPT-2 and synthetic tokens: nothing is downloaded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def tiny_gpt2(hparams: Mapping[str, Any]) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=int(hparams.get("vocab_size", 512)),
        n_positions=int(hparams.get("seq_len", 32)),
        n_embd=int(hparams.get("n_embd", 64)),
        n_layer=int(hparams.get("n_layer", 2)),
        n_head=int(hparams.get("n_head", 2)),
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


class SyntheticTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token sequences; the labels are the inputs (causal LM)."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (size, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}
