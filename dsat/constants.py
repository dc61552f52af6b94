"""Names shared by the search side and the trial side; change them here and nowhere else."""

from __future__ import annotations

# Keys in the experiment's `hyperparameters` section.
DS_CONFIG_KEY = "deepspeed_config"
OVERWRITE_KEY = "overwrite_deepspeed_args"
# A top-level hyperparameter of the trials dsat creates on a Determined cluster, where Determined's
# DeepSpeedTrial reads it to take its autotuning code path (the same key as the reference's).
DSAT_MODE_KEY = "_use_dsat_mode"

# DeepSpeed batch-size keys.
TRAIN_BATCH_SIZE = "train_batch_size"
MICRO_BATCH_SIZE = "train_micro_batch_size_per_gpu"
GRAD_ACCUM_STEPS = "gradient_accumulation_steps"
GAS_DEFAULT = 1
AUTO = "auto"

# DeepSpeed's autotuning block and the files its engine writes into the trial's working dir.
AUTOTUNING_KEY = "autotuning"
MODEL_INFO_FILE = "model_info.json"
METRICS_FILE = "autotuning_metric.json"
# What dsat_reporting_context leaves behind for a local runner: the enriched result or an OOM.
TRIAL_OUTCOME_FILE = "dsat_trial_outcome.json"
# A dsat runner's trial's hyperparameters, beside its copy of MODEL_DIR (ENV_HPARAMS_FILE names it).
HPARAMS_FILE = "dsat_hparams.json"
# The outcome a trial leaves when its script never asked for the trial's DeepSpeed config.
CONFIG_NOT_TAKEN = "config_not_taken"
# Printed to stderr by the trial side when a trial runs out of memory.
OOM_MARKER = "DSAT_TRIAL_OUT_OF_MEMORY"
# The searcher metric a trial reports on a cluster when it ran out of memory: the master only
# says "errored" of a failed trial, so the OOM travels as the trial's reported result.
OOM_METRIC_KEY = "dsat_out_of_memory"
# Likewise any other exception the training steps raised, with what it says of its cause (a
# FailureCause's value): without them the search could not say why, nor stop after a script's
# bug failed every trial alike.
ERROR_METRIC_KEY = "dsat_error"
ERROR_CAUSE_METRIC_KEY = "dsat_error_cause"
# When a trial reported its outcome, on its own clock: its end, where a restarted search runner
# reads the outcome later.
REPORTED_AT_KEY = "dsat_reported_at"
# In an OOM trial's metrics, where the memory that ran out was the host's on a GPU trial (the
# kernel's OOM killer, torch's CPU allocator): it says nothing of how much of the GPU is usable.
MEMORY_RAN_OUT = "memory_ran_out"
# In the metrics of a trial the machine failed: the host's memory ran out while other trials shared
# it, so it runs again with the machine to itself (dsat.runners.driver).
RUN_ALONE = "run_alone"

# Environment variables.
ENV_HPARAMS_FILE = "DSAT_HPARAMS_FILE"  # JSON hyperparameters written by a dsat runner
ENV_DET_MASTER = "DET_MASTER"  # set when a Determined cluster is in reach
ENV_RAY_ADDRESS = "RAY_ADDRESS"  # a Ray cluster's address, as Ray itself reads it
ENV_RESULTS_DIR = "DSAT_RESULTS_DIR"  # in every local trial: the search that started it
ENV_TRIAL_LENGTH = "DSAT_TRIAL_LENGTH"  # a local trial's searcher-operation length, in batches

RESULTS_ROOT = "dsat-results"
# In a results directory: the settings a search runs with, and its method's state.
SETTINGS_FILE = "settings.json"
STATE_FILE = "dsat_search_state.json"
# The hyperparameter a training script reads to turn on activation checkpointing (HF Trainer's
# name): where a script has it, the fit ladder may set it (dsat.search.fit_ladder).
CHECKPOINTING_HPARAM = "gradient_checkpointing"
# A trial's metric: the rows its measured steps were fed as a share of full batches, where below 1.
FULL_BATCH_SHARE = "full_batch_share"
# ... and above 1: the script fed its forwards batches of its own, larger than the trial's.
ROWS_OVER_BATCH = "rows_over_batch"
# Seconds a completed trial ran on after its result before dsat stopped it (its code after
# training blocked, or something it started kept it alive): said on its line on the terminal.
LINGERED_KEY = "lingered_s"
# The shape of every measured training forward's first input, where all had one: two trials of
# different micro-batches fed the same shape, holding neither, ran the script's own batch size.
INPUT_SHAPE = "input_shape"
# The model profile's report of the precision it ran at (fp32, fp16 or bf16): what the memory
# model counts by, where the DeepSpeed JSON leaves it to HF's Trainer ("auto").
PRECISION_KEY = "precision"
