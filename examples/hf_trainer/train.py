"""HuggingFace Trainer script tuned by dsat: a random-initialised GPT-2 on synthetic tokens.

The dsat-specific lines are the user guide's: get_hf_args_with_overwrites, so HF's batch flags
agree with the DeepSpeed config the trial tries, and dsat_reporting_context around
``trainer.train()``. On a Determined cluster, Determined's DetCallback reports HF's metrics and
hands over the searcher operation; off-cluster (dsat's local runner) there is no callback and the
operation comes from the Core API context directly.
"""

from __future__ import annotations

import os
import sys

import determined as det
import torch
from model import SyntheticTokens, tiny_gpt2
from transformers import HfArgumentParser, Trainer, TrainingArguments

import dsat


def main() -> None:
    try:
        train()
    finally:
        # DeepSpeed's autotuning ends a search trial with exit(): join the process group's
        # threads on that way out too, not at interpreter exit, where they can abort a run
        # that has already reported (exit -6, "terminate called without an active exception").
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def train() -> None:
    hparams = dsat.get_hparams()
    args = dsat.get_hf_args_with_overwrites(sys.argv[1:], hparams)
    (training_args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        args, look_for_args_file=False
    )
    print(
        f"HF per-device batch {training_args.per_device_train_batch_size}, "
        f"DeepSpeed config {training_args.deepspeed}",
        flush=True,
    )
    seq_len, vocab = int(hparams.get("seq_len", 32)), int(hparams.get("vocab_size", 512))
    dataset = SyntheticTokens(int(hparams.get("samples", 65536)), seq_len, vocab)
    eval_dataset = SyntheticTokens(64, seq_len, vocab, seed=1)
    model = tiny_gpt2(hparams)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = det.core.DistributedContext.from_torch_distributed() if world_size > 1 else None
    with det.core.init(distributed=distributed) as core_context:
        if det.get_cluster_info() is not None:
            from determined.transformers import DetCallback

            callback = DetCallback(core_context, training_args)
            callbacks, op = [callback], callback.current_op
        else:
            callbacks, op = [], next(iter(core_context.searcher.operations()))
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            callbacks=callbacks,
        )
        with dsat.dsat_reporting_context(core_context, op=op):
            result = trainer.train()
        # Reached only when DeepSpeed's autotuning did not end the run (a full training run).
        if core_context.distributed.get_rank() == 0:
            print(
                f"trained {result.global_step} steps, loss {result.training_loss:.4f}", flush=True
            )
            if not callbacks:
                op.report_completed(result.training_loss)


if __name__ == "__main__":
    main()
