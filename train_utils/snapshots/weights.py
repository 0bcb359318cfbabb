"""Weights in and out: a new run's starting weights (--init_from) read from
a kit snapshot of any strategy, nanoGPT's ``ckpt.pt`` or a Hugging Face
GPT-2 folder, named as the kit's ``gpt.GPT`` names them and loaded into the
model, sharded or not; and the kit's GPT weights named as Hugging Face's
``GPT2LMHeadModel`` names them (tools/export_hf.py).

  source                    how it is recognised             sizes from
  kit snapshot (DDP)        a file holding "model", "config"  its config's task identity
  kit snapshot (FSDP/HSDP)  a folder of DCP saves (meta.pt)   its meta.pt's task identity
  nanoGPT ckpt.pt           a file holding "model_args"       model_args
  Hugging Face GPT-2        a folder with config.json         config.json (n_positions: block_size)

Every source is read on the CPU with the weights-only unpickler (or
safetensors), so a crafted file runs no code.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from common import ConfigError
from .file import archive_damage
from .sharded import ShardedSnapshots, _position, shard_damage

# The GPT's sizes a source gives (gpt.GPTConfig's names), which a run started from it builds its model with.
SIZES = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")
# GPT-2's layers that are transformers' Conv1D (weight stored (in, out), the transpose of nn.Linear's (out, in)).
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# Buffers of GPT-2's (and nanoGPT's) attention that are no weights: the causal mask, its fill value.
MASK_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
HF_PACKAGES = "pip install transformers (it brings safetensors)"


@dataclass
class Weights:
    """A source of starting weights, read: ``kind`` in words ("Hugging Face
    GPT-2 folder", ...), ``state`` {kit parameter name: CPU tensor} (empty
    until ``read_weights`` reads the tensors), ``sizes`` the GPT's (``SIZES``;
    empty for a kit snapshot of a model that is no GPT), ``dropout`` the
    probability it was made with (tools/export_hf.py writes it)."""

    path: str
    kind: str
    state: dict = field(default_factory=dict)
    sizes: dict = field(default_factory=dict)
    dropout: float = 0.0


def _hint(path: str) -> str:
    return (f"--init_from {path}: pass a kit snapshot (snapshot_train.pt, or an FSDP snapshot folder), nanoGPT's "
            f"ckpt.pt, or a Hugging Face GPT-2 folder (model.safetensors and config.json, from save_pretrained)")


def read_sizes(path: str) -> Weights:
    """The source at ``path`` and its GPT's sizes, without reading more than
    it must (a Hugging Face folder: its config.json; a file: mapped, not
    read whole). Raises ConfigError (one line) for a path that is none of
    the sources, or a Hugging Face model that the kit's GPT cannot be
    (``hf_sizes``)."""
    return _read(path, tensors=False)


def read_weights(path: str) -> Weights:
    """The source at ``path`` with its weights: ``state`` {the kit's parameter
    name: float CPU tensor, in its stored dtype}, in ``gpt.GPT``'s layout for
    a GPT (GPT-2's Conv1D weights transposed to nn.Linear's (out, in),
    nanoGPT's ``_orig_mod.`` prefix of a compiled model dropped, the
    attention's mask buffers left out; the output layer's weight the token
    embedding's, tied, where the source stores it once). Raises ConfigError
    (one line) as ``read_sizes`` does, and for a damaged snapshot."""
    return _read(path, tensors=True)


def _read(path: str, tensors: bool) -> Weights:
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return _hf_folder(path, tensors)
        folder = _newest_save(path)
        if folder:
            return _sharded_snapshot(path, folder, tensors)
        raise ConfigError(f"{_hint(path)}; this folder holds neither config.json nor a complete snapshot "
                          f"(a sub-folder with meta.pt)")
    if not os.path.isfile(path):
        raise ConfigError(f"{_hint(path)}; there is nothing at that path")
    loaded = _torch_file(path, path, whole=tensors)
    if not isinstance(loaded, dict) or not isinstance(loaded.get("model"), dict):
        raise ConfigError(f"{_hint(path)}; this file holds no 'model' state dict")
    if "model_args" in loaded:  # nanoGPT's train.py: model, optimizer, model_args, iter_num, best_val_loss, config
        state = _gpt2_named({_without_prefix(k): v for k, v in loaded["model"].items()}, transposed=False)
        args = loaded["model_args"]
        sizes = {name: args[name] for name in SIZES if name in args}
        return Weights(path, "nanoGPT's ckpt.pt", state if tensors else {}, sizes, args.get("dropout") or 0.0)
    config = loaded.get("config", {})
    return Weights(path, "kit DDP snapshot", dict(loaded["model"]) if tensors else {},
                   _kit_sizes(config.get("task_identity", {}), loaded["model"].keys()), config.get("dropout") or 0.0)


def _torch_file(path: str, init_from: str, whole: bool):
    """What ``torch.save`` wrote at ``path`` (a file of --init_from
    ``init_from``), read on the CPU with torch's weights-only unpickler, which
    runs no code. ``whole``: its integrity checked first (``archive_damage``:
    every entry's CRC-32, the tensors' data included) and every tensor read;
    else mapped (``mmap``), its tensors read only where used: for the sizes.
    Raises ConfigError (one line) for a damaged file or one that holds more
    than tensors and plain values."""
    damage = archive_damage(path) if whole else ""
    if damage:
        raise ConfigError(f"--init_from {init_from}: cannot read {path} ({damage}); put back a good copy")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=not whole)
    except Exception as exc:
        detail = (str(exc).strip().splitlines() or [""])[0][:160]
        raise ConfigError(f"--init_from {init_from}: torch.load's weights-only unpickler cannot read {path} "
                          f"({type(exc).__name__}: {detail}); {_hint(init_from).split(': ', 1)[1]}") from None


def _without_prefix(name: str) -> str:
    """A parameter's name without torch.compile's ``_orig_mod.`` (nanoGPT saves its compiled model's)."""
    return name.removeprefix("_orig_mod.")


def _kit_sizes(identity: dict, names) -> dict:
    """A kit GPT's sizes: its task identity's (``text_tasks.gpt_identity``), the
    biases told by its keys; {} for a model that is no GPT."""
    if not all(name in identity for name in SIZES[:-1]):
        return {}
    return {**{name: identity[name] for name in SIZES[:-1]}, "bias": "ln_f.bias" in names}


def _newest_save(path: str) -> Optional[str]:
    """The sharded snapshot folder ``path`` names: itself when it holds
    ``meta.pt`` (one save), else its newest complete save (a --snapshot_path
    of --strategy fsdp: ``ShardedSnapshots``' folders); None when none."""
    if os.path.isfile(os.path.join(path, ShardedSnapshots.META)):
        return path
    saves = [(position, os.path.join(path, name)) for name in os.listdir(path)
             for position in [_position(name)]
             if position is not None and os.path.isfile(os.path.join(path, name, ShardedSnapshots.META))]
    return max(saves)[1] if saves else None


def _sharded_snapshot(path: str, folder: str, tensors: bool) -> Weights:
    """A kit sharded snapshot's weights, whole on this process: DCP reads every
    shard of ``folder``/model into full-size tensors (``no_dist``: no
    collective, whatever process group is running), checked first
    (``shard_damage``)."""
    import torch.distributed.checkpoint as dcp  # only what reads sharded saves needs DCP
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = _torch_file(os.path.join(folder, ShardedSnapshots.META), path, whole=True)
    reader = dcp.FileSystemReader(os.path.join(folder, "model"))
    shapes = {name: entry for name, entry in reader.read_metadata().state_dict_metadata.items()
              if isinstance(entry, TensorStorageMetadata)}
    config = meta.get("config", {})
    sizes = _kit_sizes(config.get("task_identity", {}), shapes)
    state = {}
    if tensors:
        damage = shard_damage(folder)
        if damage:
            raise ConfigError(f"--init_from {path}: snapshot {folder} has a damaged shard ({damage}); put back a "
                              f"good copy")
        state = {name: torch.empty(entry.size, dtype=entry.properties.dtype) for name, entry in shapes.items()}
        with warnings.catch_warnings():  # no_dist asked for: DCP's note that it loads in one process says nothing
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=True)
    return Weights(path, "kit FSDP snapshot", state, sizes, config.get("dropout") or 0.0)


def hf_sizes(config: dict, path: str) -> dict:
    """The kit GPT's sizes (``SIZES``) of a Hugging Face GPT-2 ``config``
    (config.json's dict): n_positions is block_size, and GPT-2 has biases.
    Raises ConfigError (one line) for a model that the kit's GPT is not: not
    model_type gpt2, an MLP other than 4 x n_embd wide, untied output and
    embedding weights, attention scaled otherwise than by 1/sqrt(head width).
    GPT-2's activation is the tanh approximation of GELU ("gelu_new"), the
    kit's the exact GELU (as nanoGPT's): outputs differ by at most about
    1e-3 per activation (Hendrycks & Gimpel 2016, section 2)."""
    refused = []
    if config.get("model_type") != "gpt2":
        refused.append(f"model_type {config.get('model_type')!r}, not 'gpt2'")
    if config.get("n_inner") not in (None, 4 * config.get("n_embd", 0)):
        refused.append(f"n_inner {config['n_inner']} (the kit's MLP is 4 x n_embd wide)")
    if not config.get("tie_word_embeddings", True):
        refused.append("tie_word_embeddings false (the kit's output layer is the token embedding)")
    if config.get("scale_attn_by_inverse_layer_idx") or not config.get("scale_attn_weights", True):
        refused.append("attention scaled otherwise than by 1/sqrt(head width)")
    if refused:
        raise ConfigError(f"--init_from {path}: config.json describes a model the kit's GPT is not "
                          f"({'; '.join(refused)}); start from a GPT-2 model")
    try:
        return {"n_layer": config["n_layer"], "n_head": config["n_head"], "n_embd": config["n_embd"],
                "block_size": config["n_positions"], "vocab_size": config["vocab_size"], "bias": True}
    except KeyError as exc:
        raise ConfigError(f"--init_from {path}: config.json gives no {exc.args[0]}; a GPT-2 config.json "
                          f"(save_pretrained's) gives n_layer, n_head, n_embd, n_positions, vocab_size") from None


def _hf_folder(path: str, tensors: bool) -> Weights:
    """A Hugging Face GPT-2 folder (``save_pretrained``'s): config.json, and
    model.safetensors (or its shards, model.safetensors.index.json;
    pytorch_model.bin where there is no safetensors file)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--init_from {path}: cannot read its config.json ({exc})") from None
    weights = Weights(path, "Hugging Face GPT-2 folder", sizes=hf_sizes(config, path),
                      dropout=config.get("resid_pdrop") or 0.0)
    if tensors:
        weights.state = _gpt2_named(_hf_tensors(path), transposed=True)
    return weights


def _hf_tensors(path: str) -> dict:
    """{name: tensor} of a Hugging Face folder's weight files, as stored."""
    single, index = (os.path.join(path, name) for name in ("model.safetensors", "model.safetensors.index.json"))
    if os.path.isfile(single) or os.path.isfile(index):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ConfigError(f"--init_from {path}: reading model.safetensors needs the safetensors package; "
                              f"{HF_PACKAGES}") from None
        try:
            if os.path.isfile(single):
                return load_file(single)
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            return {name: tensor for file in files for name, tensor in load_file(os.path.join(path, file)).items()}
        except Exception as exc:  # safetensors' own errors, a missing shard, a bad index
            detail = (str(exc).strip().splitlines() or [""])[0][:160]
            raise ConfigError(f"--init_from {path}: cannot read its weights ({type(exc).__name__}: {detail}); "
                              f"save the model again with save_pretrained") from None
    legacy = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(legacy):
        return _torch_file(legacy, path, whole=True)
    raise ConfigError(f"--init_from {path}: config.json but no model.safetensors (nor pytorch_model.bin); "
                      f"save the model with save_pretrained into that folder")


def _gpt2_named(state: dict, transposed: bool) -> dict:
    """GPT-2's parameter names (transformers' and nanoGPT's: ``transformer.h.0.attn.c_attn.weight``,
    the ``transformer.`` prefix optional) as ``gpt.GPT``'s (``blocks.0.attn.c_attn.weight``);
    ``transposed``: transformers' Conv1D weights (in, out), made nn.Linear's (out, in); the
    attention's mask buffers left out; the tied output layer filled in from the token embedding."""
    named = {}
    for name, tensor in state.items():
        name = name.removeprefix("transformer.")
        if MASK_BUFFER.match(name):
            continue
        if transposed and name.endswith(".weight") and name.rsplit(".", 1)[0].split(".", 2)[-1] in CONV1D:
            tensor = tensor.t().contiguous()
        named[re.sub(r"^h\.(\d+)\.", r"blocks.\1.", name)] = tensor
    if "lm_head.weight" not in named and "wte.weight" in named:
        named["lm_head.weight"] = named["wte.weight"]  # tied: stored once
    return named


def to_hf_state(state: dict) -> dict:
    """The kit GPT's ``state`` ({``gpt.GPT`` name: tensor}) named as
    transformers' ``GPT2LMHeadModel`` names it: ``transformer.`` before each,
    ``h.N`` for ``blocks.N``, the linear layers' weights transposed to
    Conv1D's (in, out); zero biases where the kit's GPT has none (--bias
    off: a bias of 0 adds nothing, so the outputs are the same);
    ``lm_head.weight`` the token embedding's (tied)."""
    hf = {}
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue
        layer = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and layer.split(".", 2)[-1] in CONV1D:
            tensor = tensor.t()
            bias = layer + ".bias"
            if bias not in state:
                hf["transformer." + re.sub(r"^blocks\.", "h.", bias)] = torch.zeros(tensor.shape[1], dtype=tensor.dtype)
        elif name.endswith(".weight") and (layer.endswith(("ln_1", "ln_2")) or layer == "ln_f") \
                and layer + ".bias" not in state:
            hf["transformer." + re.sub(r"^blocks\.", "h.", layer) + ".bias"] = torch.zeros_like(tensor)
        hf["transformer." + re.sub(r"^blocks\.", "h.", name)] = tensor.contiguous()
    hf["lm_head.weight"] = hf["transformer.wte.weight"]
    return hf


def fit_to_model(weights: Weights, shapes: dict) -> tuple[dict, str]:
    """``weights``' state checked against a model's parameters and buffers
    ``shapes`` ({name: torch.Size}, the whole tensors' under FSDP); returns
    (the state to load, a note for the start line). A position embedding
    longer than the model's ``block_size`` is cropped to its first rows (a
    shorter context: nanoGPT's ``crop_block_size``). Raises ConfigError (one
    line) naming the first parameter whose shape differs (both shapes; for
    the token embedding, the vocabularies), and for names one side lacks."""
    state = dict(weights.state)
    note = ""
    wpe = state.get("wpe.weight")
    if wpe is not None and "wpe.weight" in shapes and wpe.shape[0] > shapes["wpe.weight"][0] \
            and wpe.shape[1:] == shapes["wpe.weight"][1:]:
        state["wpe.weight"] = wpe[:shapes["wpe.weight"][0]]
        note = f"; position embedding cropped from {wpe.shape[0]} to --block_size {shapes['wpe.weight'][0]}"
    where = f"--init_from {weights.path} ({weights.kind})"
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or unexpected:
        parts = [f"this run's model has {_few(missing)}, which the weights lack"] if missing else []
        parts += [f"the weights hold {_few(unexpected)}, which this run's model lacks"] if unexpected else []
        raise ConfigError(f"{where}: {'; '.join(parts)}: weights of another model (--dataset and --model choose "
                          f"the model)")
    for name, shape in shapes.items():
        have = tuple(state[name].shape)
        if have != tuple(shape):
            if name == "wte.weight" and have[1:] == tuple(shape[1:]):
                raise ConfigError(f"{where}: its vocabulary has {have[0]:,} tokens (wte.weight {_shape(have)}), "
                                  f"this run's model {shape[0]:,} (wte.weight {_shape(shape)}): the corpus is of "
                                  f"another tokenizer; train on token ids of the weights' vocabulary")
            raise ConfigError(f"{where}: {name} is {_shape(have)} in the weights but {_shape(shape)} in this run's "
                              f"model; leave out the size flags (--n_layer, --n_head, --n_embd, --block_size): "
                              f"the weights give them")
    return state, note


def _few(names: list) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _shape(shape) -> str:
    return " x ".join(map(str, shape))


def load_initial_weights(model: torch.nn.Module, path: str, sharded: bool) -> str:
    """Load the weights of ``path`` (``read_weights``: a kit snapshot, nanoGPT's
    ckpt.pt or a Hugging Face GPT-2 folder) into ``model``, the plain model
    (DDP's ``.module``) or, ``sharded``, the FSDP-sharded one: each rank
    reads the whole state and keeps its shards (torch's
    ``set_model_state_dict`` with ``full_state_dict=True``). Every rank
    calls it (collective under FSDP) and loads the same values. Returns the
    start line: "weights from --init_from PATH (KIND): step 0, optimizer and
    schedule fresh". Raises ConfigError (one line) as ``read_weights`` and
    ``fit_to_model`` do, before the model changes."""
    weights = read_weights(path)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}  # a DTensor's: the whole's
    state, note = fit_to_model(weights, shapes)
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(state)
    return f"weights from --init_from {path} ({weights.kind}){note}: step 0, optimizer and schedule fresh"


def take_initial_sizes(args) -> None:
    """Give ``args`` (a task's copy of the command line, ``argparse.Namespace``)
    the GPT sizes of its --init_from source (``read_sizes``) where no flag
    set one: --n_layer, --n_head, --n_embd, --block_size; and, as attributes
    no flag has, ``vocab_size`` (the weights' vocabulary, which the task
    checks against its corpus's: ``token_tasks``) and ``bias``. A flag
    given stays: a smaller --block_size crops the position embedding, any
    other size that differs fails the load with one line (``fit_to_model``).
    Nothing for a source that is no GPT. Raises ConfigError as ``read_sizes``."""
    sizes = read_sizes(args.init_from).sizes
    for name, value in sizes.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
