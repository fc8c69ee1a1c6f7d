"""Entry point: `python -m stabledrl_jax.main`.

Until the trainer lands this runs the gradient-bound demonstration of the StableDRL loss.
"""
from absl import app

from stabledrl_jax import demo


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  demo.print_gradient_bound_table()


if __name__ == "__main__":
  app.run(main)
