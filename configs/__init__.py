"""The training configs: `--config=configs/sdar.py[:PRESET]` or `configs/llada.py` (found from any
directory). Each file opens with the commands that run it."""
