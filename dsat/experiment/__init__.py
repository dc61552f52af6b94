"""The experiment's inputs: the user's YAML and DeepSpeed config, batch sizes, the search settings and the metric."""
