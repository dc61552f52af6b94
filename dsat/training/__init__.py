"""What runs inside the user's training process: config from hyperparameters, dsat's step clock, reporting, OOM detection. Nothing here imports torch or DeepSpeed at import time."""
