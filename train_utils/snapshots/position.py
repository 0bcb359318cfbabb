"""Where a snapshot stands, in words: the resume line's and the save line's
(and the sharded snapshots' folder names)."""


def position(epochs_run: int, steps_run: int) -> str:
    """Where a snapshot stands, as the resume line says it: "after epoch 2",
    "in epoch 3 after step 40"."""
    return f"in epoch {epochs_run + 1} after step {steps_run}" if steps_run else f"after epoch {epochs_run}"


def position_tag(epochs_run: int, steps_run: int) -> str:
    """The same position as a short tag, for the save line and the sharded snapshots'
    folder names: "epoch 2" after epoch 2, "epoch 3 step 40" inside epoch 3."""
    return f"epoch {epochs_run + 1} step {steps_run}" if steps_run else f"epoch {epochs_run}"
