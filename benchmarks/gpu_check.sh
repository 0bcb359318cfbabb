#!/bin/bash
# The GPU check (benchmarks/gpu_check.py): diagnoses and measures what needs a
# GPU, in one command of at most 8 minutes on one H100 or H200.
#
#   benchmarks/gpu_check.sh --prepare NANOGPT [CORPUS]  # once, where nanoGPT is: copies what the check needs
#                                                        # into .gpu_check/ (ignored: fetched code is never
#                                                        # committed), to carry to the GPU machine
#   benchmarks/gpu_check.sh --out $OUT/gpu_check.json    # on the GPU machine (a lent device: under $OUT,
#                                                        # the trace beside it in gpu_check_trace/)
#   benchmarks/gpu_check.sh --dry_run                    # every part shrunk, on a CPU in a few minutes
#
# NANOGPT: a checkout of github.com/karpathy/nanoGPT, or its git directory (a bare
# clone: HEAD's files are taken); CORPUS: Tiny Shakespeare's input.txt (default:
# ../shared/data/tinyshakespeare/input.txt). $PYTHON: the Python to run (default:
# the repository's .venv where there is one, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [[ "${1:-}" == "--prepare" ]]; then
  source=${2:?"--prepare needs nanoGPT's folder (a checkout, or its git directory)"}
  corpus=${3:-../shared/data/tinyshakespeare/input.txt}
  rm -rf .gpu_check/nanoGPT
  mkdir -p .gpu_check/nanoGPT/config .gpu_check/tinyshakespeare
  for name in train.py model.py configurator.py config/train_shakespeare_char.py; do
    if [[ -f "$source/$name" ]]; then
      cp "$source/$name" ".gpu_check/nanoGPT/$name"
    else
      git --git-dir="$source" show "HEAD:$name" >".gpu_check/nanoGPT/$name"
    fi
  done
  cp "$corpus" .gpu_check/tinyshakespeare/input.txt
  echo "prepared .gpu_check/ ($(du -sh .gpu_check | cut -f1)): carry it to the GPU machine"
  exit 0
fi
exec env PYTHONUNBUFFERED=1 "$PYTHON" benchmarks/gpu_check.py "$@"
