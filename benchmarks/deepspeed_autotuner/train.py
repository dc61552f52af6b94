"""The CPU example's model, written the way DeepSpeed's own autotuner expects a script.

DeepSpeed's autotuner (`deepspeed --autotuning tune train.py --deepspeed_config ds_config.json`)
launches this script once per experiment with `--deepspeed_config` replaced by the experiment's
config; the engine measures the profile steps, writes its metric file and exits on its own.
`model.py` is copied in from examples/core_api_mlp by the benchmark.
"""

from __future__ import annotations

import argparse

import deepspeed
import torch
from model import TinyMLP, synthetic_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = TinyMLP(args.width, args.depth)
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    generator = torch.Generator().manual_seed(engine.global_rank)
    loss_fn = torch.nn.MSELoss()
    for _ in range(args.steps):
        inputs, targets = synthetic_batch(
            engine.train_micro_batch_size_per_gpu(), args.width, generator
        )
        loss = loss_fn(engine(inputs), targets)
        engine.backward(loss)
        engine.step()


if __name__ == "__main__":
    main()
