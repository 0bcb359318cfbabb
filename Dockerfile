# The image the kit and the ladder run in: a base image's Python and torch,
# plus requirements.txt, train.py with its train_utils package and its tools,
# and the five rungs at /workspace. docs/containers.md has the commands (docker, podman,
# two nodes, Apptainer, Slurm) and what was tested.
#
#   docker build -t ddp-scripts .
#   docker run -it --rm --gpus all --network=host --ipc=host ddp-scripts
#
# --ipc=host: Docker gives a container 64 MB of /dev/shm, too little for
# NCCL's shared-memory transport and DataLoader workers (--shm-size=8g also works).
#
# BASE: any image with python3 and pip. The default is an official PyTorch
# CUDA runtime image (torch 2.14 with CUDA 12.6; pick the -cudaXX.Y tag your
# driver supports); requirements.txt then installs only what it lacks. A
# plain Python base (e.g. Debian's python3 + python3-pip) gets torch from PyPI,
# the CUDA build, which runs on a CPU too.
ARG BASE=pytorch/pytorch:2.14.0-cuda12.6-cudnn9-runtime
FROM ${BASE}

# PIP_CERT: the path of a CA bundle, inside the build, for pip behind a
# TLS-intercepting proxy; mount the bundle for the build only, e.g.
#   podman build -v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro \
#       --build-arg PIP_CERT=/run/host-ca.crt ...
# Empty (the default): pip's own certificates.
ARG PIP_CERT=""

ENV PYTHONUNBUFFERED=1
WORKDIR /workspace

# Dependencies first, so that editing a script does not reinstall torch.
# PIP_BREAK_SYSTEM_PACKAGES: a distribution's Python (Debian 12) refuses
# `pip install` outside a virtual environment (PEP 668); in an image the
# system Python is the one to install into. Other Pythons ignore it. Where
# only python3 exists (Debian), `python` is made to name it, as the seeds and
# slurm/single_gpu.sh call it.
COPY requirements.txt ./
RUN if [ -z "$PIP_CERT" ]; then unset PIP_CERT; fi \
    && PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
       python3 -m pip install --no-cache-dir -r requirements.txt \
    && python3 -c "import torch, torchvision, tqdm; print('torch', torch.__version__, '| torchvision', torchvision.__version__)" \
    && { command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python; }

# The project: train.py (the kit), its train_utils package (its distributed/,
# loop/, logs/ and snapshots/ subpackages) and the programs beside it (tools/),
# the five rungs, and the task modules (a bind mount of a checkout over
# /workspace, -v "$PWD":/workspace, works as well).
COPY *.py ./
COPY train_utils/ ./train_utils/
COPY tools/ ./tools/

CMD ["bash"]
