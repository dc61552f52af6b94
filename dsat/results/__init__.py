"""What a search leaves in its results directory (trials.jsonl, best config, summary, state), reading it back to resume, the report, and the progress shown while it runs."""
