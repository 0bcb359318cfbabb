"""Where a snapshot stands, in words: the resume line's and the save line's
(and the sharded snapshots' folder names)."""

from typing import Optional


def position(epochs_run: int, steps_run: int) -> str:
    """Where a snapshot stands, as the resume line says it: "after epoch 2",
    "in epoch 3 after step 40"."""
    return f"in epoch {epochs_run + 1} after step {steps_run}" if steps_run else f"after epoch {epochs_run}"


def position_tag(epochs_run: int, steps_run: int) -> str:
    """The same position as a short tag, for the save line and the sharded snapshots'
    folder names: "epoch 2" after epoch 2, "epoch 3 step 40" inside epoch 3."""
    return f"epoch {epochs_run + 1} step {steps_run}" if steps_run else f"epoch {epochs_run}"


def tag_position(name: str) -> Optional[tuple]:
    """(epochs_run, steps_run) of a name made of ``position_tag`` with dashes
    ("epoch-2", "epoch-3-step-40": a sharded snapshot's folder), else None."""
    parts = name.split("-")
    if len(parts) == 2 and parts[0] == "epoch" and parts[1].isdigit():
        return int(parts[1]), 0
    if len(parts) == 4 and parts[0] == "epoch" and parts[2] == "step" and \
            parts[1].isdigit() and parts[3].isdigit() and int(parts[1]) > 0:
        return int(parts[1]) - 1, int(parts[3])
    return None
