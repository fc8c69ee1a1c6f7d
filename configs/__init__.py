"""The training configs: `--config=configs/sdar.py[:PRESET]`, `configs/llada.py` or
`configs/dream.py` (found from any directory). Each file opens with the commands that run it."""
