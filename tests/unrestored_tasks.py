"""Tasks of a user's that break exact resume without a sign, each in its own
way, for tests/test_check_resume.py (``--dataset unrestored_tasks.py:NAME``).
Each is the synthetic regression task (common.synthetic_task) with one change:

- ``own_generator_task``: its training transform adds noise drawn from a
  ``torch.Generator`` of its own, made when the task is built: no snapshot
  holds it, so a resumed run draws the noise of the run's first steps again.
- ``global_random_task``: its training transform scales each batch by a draw
  from Python's global ``random``, which a fresh process seeds anew.
- ``counter_model_task``: its model counts its training forwards in a plain
  attribute, outside its ``state_dict``, and scales its output by the count.
"""

import random

import torch

import common


class OwnGeneratorNoise:
    """A batch's inputs plus Gaussian noise (std 0.1) from the transform's own generator."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(inputs.shape, generator=self.generator).to(inputs.device)
        return inputs + 0.1 * noise


def global_random_scale(inputs: torch.Tensor) -> torch.Tensor:
    """A batch's inputs scaled by 1 + a draw in [0, 0.1) from Python's global ``random``."""
    return inputs * (1 + 0.1 * random.random())


class CountingModel(torch.nn.Module):
    """``inner``'s output x (1 + calls / 100), ``calls`` its training forwards so
    far: a plain int, which ``state_dict`` does not hold."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return self.inner(inputs) * (1 + self.calls / 100)


def own_generator_task(args, download):
    task = common.synthetic_task(args, download)
    task.train_transform = OwnGeneratorNoise(args.seed)
    return task


def global_random_task(args, download):
    task = common.synthetic_task(args, download)
    task.train_transform = global_random_scale
    return task


def counter_model_task(args, download):
    task = common.synthetic_task(args, download)
    task.model = CountingModel(task.model)
    return task
