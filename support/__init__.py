"""What the tests (tests/) and the benchmark (benchmarks/) both use, and
neither owns: running the scripts as a user does and reading what they print
and save (``runs``), small datasets in the real on-disk formats (``data``),
and train.py's Trainer built in process (``trainer``). Not part of the
scripts or the kit: a copy of them needs none of it."""
