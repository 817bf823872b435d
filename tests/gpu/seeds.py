"""Fresh, reproducible CUDA generators for the GPU tests: each call of a stream's
`next_generator` seeds a new generator with the stream's next seed."""
import itertools

import torch


class SeedStream:
    def __init__(self, first_seed: int):
        self._seeds = itertools.count(first_seed)

    def next_generator(self) -> torch.Generator:
        return torch.Generator(device="cuda").manual_seed(next(self._seeds))
