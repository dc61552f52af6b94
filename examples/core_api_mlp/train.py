"""Core API training loop, tuned by dsat: the user guide's pattern, runnable on a CPU.

Run it through dsat (`python3 -m dsat guided deepspeed.yaml .`) or on a Determined cluster; the
only dsat-specific lines are get_hparams, get_ds_config_from_hparams and dsat_reporting_context.
"""

from __future__ import annotations

import os

import deepspeed
import determined as det
import torch
from model import TinyMLP, synthetic_batch

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
    ds_config = dsat.get_ds_config_from_hparams(hparams)
    deepspeed.init_distributed()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = det.core.DistributedContext.from_torch_distributed() if world_size > 1 else None

    torch.manual_seed(0)
    width, depth = int(hparams.get("width", 256)), int(hparams.get("depth", 4))
    model = TinyMLP(width, depth)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    generator = torch.Generator().manual_seed(engine.global_rank)
    # The engine's precision (bf16 or fp16 in the DeepSpeed config) is the batch's too.
    dtype = next(engine.module.parameters()).dtype
    loss_fn = torch.nn.MSELoss()

    with det.core.init(distributed=distributed) as core_context:
        for op in core_context.searcher.operations():
            steps = int(hparams.get("steps", op.length))
            loss = torch.zeros(())
            with dsat.dsat_reporting_context(core_context, op):
                # Optimizer steps, not micro-steps: with gradient accumulation (a fixed global
                # batch) each takes several micro-batches.
                while engine.global_steps < steps:
                    inputs, targets = synthetic_batch(
                        engine.train_micro_batch_size_per_gpu(), width, generator
                    )
                    inputs, targets = inputs.to(dtype), targets.to(dtype)
                    loss = loss_fn(engine(inputs), targets)
                    engine.backward(loss)
                    engine.step()
            # Reached only when DeepSpeed's autotuning did not end the trial (a full run).
            if core_context.distributed.get_rank() == 0:
                metrics = {"loss": loss.item()}
                print(f"trained {steps} steps, loss {metrics['loss']:.4f}", flush=True)
                core_context.train.report_validation_metrics(steps_completed=steps, metrics=metrics)
                op.report_completed(metrics["loss"])


if __name__ == "__main__":
    main()
