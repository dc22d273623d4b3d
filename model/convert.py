"""HF <-> Megatron weights of the glm5_next text model, in the published GLM-5.3-Flash layout.

HF side: the key names of the published checkpoint (what ``Glm5NextForConditionalGeneration.
save_pretrained`` writes and vLLM's glm5_next loader reads): ``model.language_model.layers.{i}.``
with per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``hc_attn_fn`` / ``hc_ffn_base``
..., KDA ``self_attn.{q,k,v}_conv1d.weight [C, 1, K]`` and ``self_attn.f_a_proj`` (no
``forget_gate.`` level), ``lm_head.weight``; ``config.json`` with ``architectures =
["Glm5NextForConditionalGeneration"]`` (:func:`model.config.hf_config_dict`). transformers 5.19
has no text-only class, so an export carries a vision tower: the source checkpoint's, passed
through unchanged, or a minimal one (:data:`model.config.MINIMAL_VISION_CONFIG`) from a fixed seed.

Megatron side: the state dict of :class:`model.glm5_next.Glm5NextModel` on one rank. Sharding:
TP splits the column-parallel weights on dim 0 (KDA q/k/v/b/f_b/g_b projections, convolutions,
``dt_bias``, ``A_log``; MLA ``q_b``/``kv_b``; embedding and output head by vocabulary rows;
gated ``linear_fc1`` as ``[gate_r; up_r]`` per rank) and the row-parallel ones on dim 1
(``o_proj``, ``linear_fc2``); EP gives rank ``r`` experts ``[r*E/ep, (r+1)*E/ep)`` whole (expert
tensor parallelism 1). Everything else is replicated. The round trip HF -> Megatron -> HF is
bit-identical (pure slicing and concatenation).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Mapping

import torch

from model.config import DSA, Glm5NextConfig, from_hf, hf_config_dict

__all__ = [
    "ConversionError",
    "LazySafetensors",
    "hf_to_megatron",
    "megatron_to_hf",
    "hf_state_dict",
    "save_hf_checkpoint",
    "load_hf_checkpoint",
    "export_metadata",
    "load_hf_into_model",
    "load_megatron_state",
]

HF_PREFIX = "model.language_model."


class ConversionError(ValueError):
    """A state dict that does not match the config (missing/unexpected keys, wrong shapes, sharding)."""


_KDA_DIRECT = {
    "q_proj.weight": "q_proj.weight", "k_proj.weight": "k_proj.weight", "v_proj.weight": "v_proj.weight",
    "b_proj.weight": "b_proj.weight", "f_a_proj.weight": "f_a_proj.weight", "f_b_proj.weight": "f_b_proj.weight",
    "g_a_proj.weight": "g_a_proj.weight", "g_b_proj.weight": "g_b_proj.weight", "o_proj.weight": "o_proj.weight",
    "dt_bias": "dt_bias", "A_log": "A_log", "o_norm_weight": "o_norm.weight",
}
_DSA_DIRECT = {
    "q_a_proj.weight": "q_a_proj.weight", "q_a_layernorm.weight": "q_a_layernorm.weight",
    "q_b_proj.weight": "q_b_proj.weight", "kv_a_proj_with_mqa.weight": "kv_a_proj_with_mqa.weight",
    "kv_a_layernorm.weight": "kv_a_layernorm.weight", "kv_b_proj.weight": "kv_b_proj.weight",
    "o_proj.weight": "o_proj.weight",
}
_INDEXER = {
    "wq_b.weight": "wq_b.weight", "wk.weight": "wk.weight", "k_norm.weight": "k_norm.weight",
    "k_norm.bias": "k_norm.bias", "weights_proj.weight": "weights_proj.weight",
    "kpool_compress_ape": "index_kpool_compress_ape", "kpool_compress_gate": "index_kpool_compress_gate",
}
# Megatron suffix -> TP split dim (None = replicated). Gated fc1 is handled separately.
_COLUMN = re.compile(r"mixer\.(q_proj|k_proj|v_proj|b_proj|f_b_proj|g_b_proj|q_b_proj|kv_b_proj)\.weight$"
                     r"|mixer\.(q_conv|k_conv|v_conv|dt_bias|A_log)$|^embedding\.weight$|^output_layer\.weight$")
_ROW = re.compile(r"mixer\.o_proj\.weight$|mlp\.linear_fc2\.weight$|mlp\.shared_experts\.linear_fc2\.weight$")
_GATED = re.compile(r"mlp\.linear_fc1\.weight$|mlp\.shared_experts\.linear_fc1\.weight$")


def _layer_pairs(cfg: Glm5NextConfig, i: int):
    """(megatron key, HF key or tuple of HF keys, kind) of layer ``i``, kind in {plain, conv, gated, expert*}."""
    m, h = f"layers.{i}.", f"{HF_PREFIX}layers.{i}."
    out = []
    for hc, name in (("attn_hc", "hc_attn"), ("ffn_hc", "hc_ffn")):
        for p in ("fn", "base", "scale"):
            out.append((f"{m}{hc}.{p}", f"{h}{name}_{p}", "plain"))
    out.append((f"{m}input_layernorm.weight", f"{h}input_layernorm.weight", "plain"))
    out.append((f"{m}post_attention_layernorm.weight", f"{h}post_attention_layernorm.weight", "plain"))
    if cfg.layer_types[i] == DSA:
        out += [(f"{m}mixer.{a}", f"{h}self_attn.{b}", "plain") for a, b in _DSA_DIRECT.items()]
        if cfg.indexer_types[i] == "full":
            out += [(f"{m}mixer.indexer.{a}", f"{h}self_attn.indexer.{b}", "plain") for a, b in _INDEXER.items()]
    else:
        out += [(f"{m}mixer.{a}", f"{h}self_attn.{b}", "plain") for a, b in _KDA_DIRECT.items()]
        out += [(f"{m}mixer.{c}_conv", f"{h}self_attn.{c}_conv1d.weight", "conv") for c in "qkv"]
    if cfg.mlp_layer_types[i] == "sparse":
        out.append((f"{m}mlp.router.weight", f"{h}mlp.gate.weight", "plain"))
        out.append((f"{m}mlp.router.expert_bias", f"{h}mlp.gate.e_score_correction_bias", "plain"))
        out.append((f"{m}mlp.shared_experts.linear_fc1.weight",
                    (f"{h}mlp.shared_experts.gate_proj.weight", f"{h}mlp.shared_experts.up_proj.weight"), "gated"))
        out.append((f"{m}mlp.shared_experts.linear_fc2.weight", f"{h}mlp.shared_experts.down_proj.weight", "plain"))
        for e in range(cfg.num_moe_experts):
            out.append((f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight",
                        (f"{h}mlp.experts.{e}.gate_proj.weight", f"{h}mlp.experts.{e}.up_proj.weight"), "gated"))
            out.append((f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight",
                        f"{h}mlp.experts.{e}.down_proj.weight", "plain"))
    else:
        out.append((f"{m}mlp.linear_fc1.weight", (f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"), "gated"))
        out.append((f"{m}mlp.linear_fc2.weight", f"{h}mlp.down_proj.weight", "plain"))
    return out


def _pairs(cfg: Glm5NextConfig):
    out = [("embedding.weight", f"{HF_PREFIX}embed_tokens.weight", "plain"),
           ("final_norm.weight", f"{HF_PREFIX}norm.weight", "plain"),
           ("output_layer.weight", "lm_head.weight", "plain")]
    for i in range(cfg.num_layers):
        out += _layer_pairs(cfg, i)
    return out


def _expert_local(key: str, cfg: Glm5NextConfig, ep_rank: int, ep_size: int) -> str | None:
    """Map a global expert key to this EP rank's local key (None if the expert lives elsewhere)."""
    m = re.search(r"local_experts\.(\d+)\.", key)
    if m is None:
        return key
    per = cfg.num_moe_experts // ep_size
    e = int(m.group(1))
    if not ep_rank * per <= e < (ep_rank + 1) * per:
        return None
    return key.replace(f"local_experts.{e}.", f"local_experts.{e - ep_rank * per}.")


def hf_to_megatron(hf: Mapping[str, torch.Tensor], cfg: Glm5NextConfig, tp_rank: int = 0, tp_size: int = 1,
                   ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Megatron state dict of rank (``tp_rank``, ``ep_rank``) from HF-named tensors.

    Raises:
        ConversionError: a key of the config is missing from ``hf``, or a shape does not split.
    """
    if cfg.num_moe_experts and cfg.num_moe_experts % ep_size:
        raise ConversionError(f"{cfg.num_moe_experts} experts do not split over expert-parallel size {ep_size}")
    out = {}
    for mkey, hkey, kind in _pairs(cfg):
        local = _expert_local(mkey, cfg, ep_rank, ep_size)
        if local is None:
            continue
        try:
            if kind == "gated":
                gate, up = hf[hkey[0]], hf[hkey[1]]
                if "local_experts" not in mkey:
                    gate, up = _split(gate, 0, tp_rank, tp_size, hkey[0]), _split(up, 0, tp_rank, tp_size, hkey[1])
                t = torch.cat([gate, up], 0)
            elif kind == "conv":
                t = _split(hf[hkey].squeeze(1), 0, tp_rank, tp_size, hkey)
            else:
                t = hf[hkey]
                if "local_experts" not in mkey and _COLUMN.search(mkey):
                    t = _split(t, 0, tp_rank, tp_size, hkey)
                elif "local_experts" not in mkey and _ROW.search(mkey):
                    t = _split(t, 1, tp_rank, tp_size, hkey)
        except KeyError as err:
            raise ConversionError(f"HF state dict has no {err.args[0]!r} (needed for megatron {mkey!r})") from None
        out[local] = t.clone()
    return out


def _split(t: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ConversionError(f"{name}: dim {dim} of shape {tuple(t.shape)} does not split over TP size {size}")
    return t.chunk(size, dim)[rank]


def megatron_to_hf(shards: list[list[Mapping[str, torch.Tensor]]], cfg: Glm5NextConfig) -> dict[str, torch.Tensor]:
    """HF-named tensors from megatron state dicts of every rank.

    Args:
        shards: ``shards[ep_rank][tp_rank]`` = that rank's megatron state dict (one ``[[sd]]`` on a
            single rank).
        cfg: the model config.

    Raises:
        ConversionError: a key is missing or the shards disagree with the config.
    """
    ep_size, tp_size = len(shards), len(shards[0])
    per = (cfg.num_moe_experts or 0) // ep_size
    out = {}
    for mkey, hkey, kind in _pairs(cfg):
        m = re.search(r"local_experts\.(\d+)\.", mkey)
        if m:
            e = int(m.group(1))
            src = [shards[e // per][0]]
            mkey = mkey.replace(f"local_experts.{e}.", f"local_experts.{e % per}.")
        else:
            src = shards[0]
        try:
            parts = [sd[mkey] for sd in src]
        except KeyError:
            raise ConversionError(f"megatron state dict has no {mkey!r}") from None
        if kind == "gated":
            halves = [p.chunk(2, 0) for p in parts]
            out[hkey[0]] = torch.cat([g for g, _ in halves], 0).clone()
            out[hkey[1]] = torch.cat([u for _, u in halves], 0).clone()
        elif kind == "conv":
            out[hkey] = torch.cat(parts, 0).unsqueeze(1).clone()
        elif len(parts) > 1 and _COLUMN.search(mkey):
            out[hkey] = torch.cat(parts, 0).clone()
        elif len(parts) > 1 and _ROW.search(mkey):
            out[hkey] = torch.cat(parts, 1).clone()
        else:
            out[hkey] = parts[0].clone()
    return out


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """In-memory HF-named state dict of a model, gathered over TP and EP ranks.

    Every rank of the TP and EP groups must call it (collective); every rank gets the full dict.
    Used to push weights to an inference engine without a file round trip.
    """
    from megatron.core import parallel_state as ps

    cfg = model.config
    # ``_extra_state`` entries are None (no TransformerEngine FP8 state) and token counters are not weights.
    sd = {k: v.detach() for k, v in model.state_dict().items()
          if v is not None and not k.endswith(("local_tokens_per_expert", "_extra_state"))}
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    ep = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if tp == 1 and ep == 1:
        return megatron_to_hf([[sd]], cfg)
    tp_group, ep_group = ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group()
    tp_parts = [_gather_dict(sd, tp_group, tp)]
    if ep > 1:
        # Each EP rank's TP shards: gather the TP-gathered lists of all EP ranks.
        objs = [None] * ep
        torch.distributed.all_gather_object(objs, tp_parts[0], group=ep_group)
        tp_parts = objs
    return megatron_to_hf(tp_parts, cfg)


def _gather_dict(sd, group, size):
    if size == 1:
        return [sd]
    objs = [None] * size
    torch.distributed.all_gather_object(objs, sd, group=group)
    return objs


def export_metadata(preset: str, data_manifest_sha256: str | None, repo: Path | None = None) -> dict[str, str]:
    """Metadata stored in the safetensors header: preset, data manifest hash, git commit of ``repo``."""
    repo = repo or Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"format": "pt", "megabase_preset": preset, "megabase_data_manifest_sha256": data_manifest_sha256 or "",
            "megabase_git_commit": commit}


def canonicalize_safetensors_header(path: str | os.PathLike) -> None:
    """Rewrite a safetensors file's JSON header with sorted keys, in place (same length).

    safetensors serializes the ``__metadata__`` map from a Rust ``HashMap``, whose order changes
    from process to process, so two exports of the same weights differed in their bytes, and
    every content hash over them (stage cache keys, SFT manifests) changed with it. Sorting
    the keys makes the bytes a function of the content. The header keeps its length (padded
    with spaces, which the format allows), so tensor offsets are untouched.

    Raises:
        ValueError: the sorted header would not fit the original length (non-ASCII escaping).
    """
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > size:
            raise ValueError(f"{path}: canonical safetensors header is {len(text)} bytes, the file has {size}")
        f.seek(8)
        f.write(text.ljust(size, b" "))


def save_hf_checkpoint(hf: Mapping[str, torch.Tensor], cfg: Glm5NextConfig, out_dir: Path, metadata: dict[str, str],
                       vision_state: Mapping[str, torch.Tensor] | None = None,
                       vision_config: Mapping | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (published GLM-5.3-Flash layout) to ``out_dir``.

    ``vision_state``/``vision_config`` pass a source checkpoint's vision tower through; without
    them a minimal vision tower is written from ``torch.manual_seed(0)``. ``metadata`` goes into
    the safetensors header and ``megabase_export.json``.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_config_dict(cfg, vision_config)
    if vision_state is None:
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

        gen_state = torch.random.get_rng_state()
        torch.manual_seed(0)
        vision = Glm5NextVisionModel._from_config(Glm5NextVisionConfig(**config["vision_config"]))
        torch.random.set_rng_state(gen_state)
        vision_state = {f"model.visual.{k}": v for k, v in vision.state_dict().items()}
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() and "e_score_correction_bias" not in k
                   else v).contiguous() for k, v in hf.items()}
    tensors.update({k: v.contiguous() for k, v in vision_state.items()})
    save_file(tensors, str(out_dir / "model.safetensors"), metadata=dict(metadata))
    canonicalize_safetensors_header(out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out_dir / "megabase_export.json").write_text(json.dumps(dict(metadata), indent=2, sort_keys=True))
    return out_dir


class LazySafetensors(Mapping):
    """Read-on-access mapping over the tensors of ``*.safetensors`` files: ``m[name]`` reads that tensor alone.

    :func:`hf_to_megatron` asks only for what its rank keeps (its expert-parallel share of the
    routed experts; whole dense tensors, then split for TP), so a rank of a large layout reads
    about its shard of the export instead of all of it: the full model's export is ~627 GB of
    bf16, mostly routed experts, and eight ranks of a node each holding all of it would not fit
    in host memory. Each access reads the tensor again (no cache); files stay memory-mapped
    through ``safetensors.safe_open`` while the mapping lives.

    Raises:
        KeyError: a name no file holds.
    """

    def __init__(self, files: list[Path], keep=lambda name: True):
        from safetensors import safe_open

        self._files = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: handle for handle in self._files for name in handle.keys() if keep(name)}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_hf_checkpoint(
    path: Path, lazy: bool = False, **overrides
) -> tuple[Glm5NextConfig, Mapping[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Read a GLM-5.3-Flash-layout checkpoint directory: ``(config, text tensors, vision tensors)``.

    Reads every ``*.safetensors`` shard; ``overrides`` go to :func:`model.config.from_hf`. With
    ``lazy`` the text tensors are a :class:`LazySafetensors` (each read when accessed: what a rank
    of a parallel layout uses, through :func:`load_hf_into_model`); the vision tower is small and
    read whole either way.
    """
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    cfg = from_hf(config, **overrides)
    files = sorted(path.glob("*.safetensors"))
    if lazy:
        text = LazySafetensors(files, keep=lambda k: not k.startswith("model.visual."))
        visual = LazySafetensors(files, keep=lambda k: k.startswith("model.visual."))
        return cfg, text, {k: visual[k] for k in visual}
    text, vision = {}, {}
    for f in files:
        for k, v in load_file(str(f)).items():
            (vision if k.startswith("model.visual.") else text)[k] = v
    return cfg, text, vision


def state_sha256(hf: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of a state dict (sorted by name)."""
    h = hashlib.sha256()
    for k in sorted(hf):
        t = hf[k].contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def load_megatron_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a megatron state dict (from :func:`hf_to_megatron`) into ``model`` exactly.

    Raises:
        ConversionError: a parameter or buffer of the model is missing from ``state``, or
            ``state`` has keys the model does not (``_extra_state`` placeholders and MoE token
            counters are not weights and are skipped).
    """
    result = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(("_extra_state", "local_tokens_per_expert"))]
    if missing or result.unexpected_keys:
        raise ConversionError(f"missing {missing[:5]} ({len(missing)}), unexpected {result.unexpected_keys[:5]}")


def load_hf_into_model(model: torch.nn.Module, hf: Mapping[str, torch.Tensor]) -> None:
    """Load HF-named tensors into this rank's model, sharded by megatron ``parallel_state`` (TP, EP).

    Raises:
        ConversionError: as :func:`hf_to_megatron` and :func:`load_megatron_state`.
    """
    from megatron.core import parallel_state as ps

    init = ps.model_parallel_is_initialized()
    tp_rank, tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()) if init else (0, 1)
    ep_rank, ep = (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()) if init else (0, 1)
    state = hf_to_megatron(hf, model.config, tp_rank=tp_rank, tp_size=tp, ep_rank=ep_rank, ep_size=ep)
    current = model.state_dict()
    load_megatron_state(model, {k: v.to(device=current[k].device, dtype=current[k].dtype) for k, v in state.items()})
