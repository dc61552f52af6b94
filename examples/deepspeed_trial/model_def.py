"""A DeepSpeedTrial tuned by dsat: the only dsat line is get_ds_config_from_hparams.

In dsat's trials the hyperparameters carry ``_use_dsat_mode``, and Determined's DeepSpeedTrial
controller then runs the profiling steps inside dsat's reporting context by itself. Determined
0.37 runs DeepSpeedTrial only on a cluster with GPUs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import deepspeed
from attrdict import AttrDict
from determined.pytorch import DataLoader
from determined.pytorch.deepspeed import DeepSpeedTrial, DeepSpeedTrialContext
from model import Regressor, SyntheticRegression, train_step, validation_loss

import dsat


class RegressorTrial(DeepSpeedTrial):  # type: ignore[misc]
    def __init__(self, context: DeepSpeedTrialContext) -> None:
        self.context = context
        self.hparams = AttrDict(context.get_hparams())
        ds_config = dsat.get_ds_config_from_hparams(context.get_hparams())
        model = Regressor(self.hparams.width, self.hparams.depth)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config
        )
        self.engine = context.wrap_model_engine(engine)

    def build_training_data_loader(self) -> DataLoader:
        dataset = SyntheticRegression(self.hparams.samples, self.hparams.width)
        # drop_last: a partial batch at an epoch's end inside the measured steps would count as
        # a full one (docs/porting-hf-trainer.md).
        return DataLoader(
            dataset,
            batch_size=self.engine.train_micro_batch_size_per_gpu(),
            shuffle=True,
            drop_last=True,
        )

    def build_validation_data_loader(self) -> DataLoader:
        dataset = SyntheticRegression(256, self.hparams.width, seed=1)
        return DataLoader(dataset, batch_size=self.engine.train_micro_batch_size_per_gpu())

    def train_batch(
        self, dataloader_iter: Iterator[Any] | None, epoch_idx: int, batch_idx: int
    ) -> dict[str, Any]:
        assert dataloader_iter is not None
        return {"loss": train_step(self.engine, self.context.to_device(next(dataloader_iter)))}

    def evaluate_batch(
        self, dataloader_iter: Iterator[Any] | None, batch_idx: int
    ) -> dict[str, Any]:
        assert dataloader_iter is not None
        batch = self.context.to_device(next(dataloader_iter))
        return {"val_loss": validation_loss(self.engine, batch)}
