# Sourced by the GPU check's scripts (benchmarks/README.md, "GPU"): installs the wheels
# ../shared/GPU.md lists (in .whl/) and writes the HF Trainer example sized as GPT-2 medium
# (random-initialised, bf16, sequence 1024) to /tmp/gpt2_medium.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
work=/tmp/gpt2_medium
rm -rf "$work" && cp -r examples/hf_trainer "$work"
python3 - "$work" <<'PY'
import json, sys
from pathlib import Path
import yaml
work = Path(sys.argv[1])
experiment = yaml.safe_load((work / "deepspeed.yaml").read_text())
experiment["name"] = "hf-trainer-gpt2-medium"
experiment["hyperparameters"].update(
    n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, seq_len=1024, samples=4096
)
entry = experiment["entrypoint"].split()
for flag in ("--eval_steps", "--per_device_eval_batch_size"):
    at = entry.index(flag)
    del entry[at : at + 2]
entry[entry.index("--eval_strategy") + 1] = "no"
experiment["entrypoint"] = " ".join(entry + ["--bf16"])
(work / "deepspeed.yaml").write_text(yaml.safe_dump(experiment, sort_keys=False))
config = json.loads((work / "ds_config.json").read_text())
config["bf16"] = {"enabled": "auto"}
(work / "ds_config.json").write_text(json.dumps(config, indent=2))
PY
