"""A freshly initialised model of a train.py preset, saved as a checkpoint, for the benchmarks that
time a scorer (speed does not depend on the weights)."""
import os
import tempfile
from pathlib import Path

import torch

import train as T


def save_random_checkpoint(preset: str = "cpu", random_projections: bool = False) -> str:
    """Save a `preset` model straight from init_weights and return its path. init_weights zeroes the
    blocks' output projections; `random_projections` gives them random values, so attention and the
    MLPs count when two scorers' losses are compared."""
    model = T.build_model(T.model_config(T.parse_command_line(["--preset", preset])[0]))
    if random_projections:
        with torch.no_grad():
            for block in model.blocks:
                torch.nn.init.normal_(block.attn.c_proj.weight, std=0.02)
                torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.02)
    path = os.path.join(tempfile.mkdtemp(prefix="bench-"), "final.pt")
    T.save_checkpoint(Path(path), model, {})
    return path
