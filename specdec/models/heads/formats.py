"""Draft heads in the layouts users download, read into ours and written back out (`specdec convert-head`).

Ours, per method (what the head classes load; `HeadCheckpoint` carries it):

    eagle3  SpecForge's: a Llama config.json + `draft_vocab_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`
            (the OUTPUTS of those target layers, SGLang's sense) and the options of `Eagle3Variant`; tensors
            fc, midlayer.*, layers.{i>=1}.*, norm, lm_head, d2t (offsets: target id = draft id + d2t), t2d,
            and where present input_norm, fc_norm.{i}, embed_tokens
    eagle   the EAGLE reference: fc (+ bias), layers.{i}.*, optional enorm / hnorm / norm
    mtp     DeepSeek's MTP module: model.layers.{L}.{enorm, hnorm, eh_proj, self_attn.*, mlp.*, shared_head.*}
    medusa  the Medusa reference: medusa_head.{i}.{j}.linear.*, optional medusa_head.{i}.{L}.weight

Read (FORMATS; each option honoured or refused by name, never dropped):

    specforge    ours; also the EAGLE reference's EAGLE-3 and AngelSlim's (the same names), .bin or .safetensors
    eagle        the EAGLE reference's EAGLE-1/2 heads (`bias`, layer 0 without input_layernorm), .bin
    speculators  vLLM's speculators (`speculators_model_type` eagle3 / eagle): `transformer_layer_config`,
                 `layers.0.*`, layer ids in vLLM's sense (the INPUTS of those layers: ours + 1)
    medusa       the Medusa reference (`medusa_lm_head.pt`), and vLLM's converted Medusa (`model_type: medusa`)
    gguf         llama.cpp's EAGLE-3 GGUF, and MTP (`nextn`) layers inside a GGUF model (`head_gguf`)
    mtp          MTP layers inside a Hugging Face model (`num_nextn_predict_layers`)
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from specdec.config import SpecdecError
from specdec.models.heads.files import HeadCheckpoint, head_location, read_head_config, read_head_tensors
from specdec.models.heads.gguf import read_gguf_head, write_gguf_head

METHOD_NAMES = {"eagle3": "EAGLE-3", "eagle": "EAGLE", "mtp": "MTP", "medusa": "Medusa"}
FORMATS = ("specforge", "eagle", "speculators", "medusa", "gguf")
_OUR_ARCHITECTURES = {"eagle": "EagleHead", "mtp": "DeepseekMTPHead", "medusa": "MedusaModel"}
WRITES = {"eagle3": ("specforge", "eagle", "speculators", "gguf"), "eagle": ("specforge", "eagle", "speculators"),
          "mtp": ("specforge",), "medusa": ("specforge", "medusa")}


def read_head(path: str | Path, method: str) -> HeadCheckpoint:
    """The head in `path` (a directory, one weight file, a GGUF, a Hub id, or for `mtp` a model whose files hold
    MTP layers) in our layout for `method`; a head of another method, or an option we do not implement, is an
    error naming it."""
    what = METHOD_NAMES.get(method, method)
    directory, file = head_location(path, what)
    gguf = file if file is not None and file.suffix == ".gguf" else _lone_gguf(directory)
    if gguf is not None:
        return read_gguf_head(gguf, method)
    directory, config = read_head_config(directory, what)
    if method == "mtp" and config.get("num_nextn_predict_layers"):
        return _mtp_inside(directory, config, read_head_tensors(directory, what, file))
    tensors = read_head_tensors(directory, what, file)
    if "speculators_model_type" in config:
        ckpt = _from_speculators(directory, config, tensors, method)
    elif config.get("model_type") == "medusa":
        ckpt = _from_vllm_medusa(directory, config, tensors, method)
    else:
        found = detect_method(config, tensors)
        if found is not None and found != method:
            raise SpecdecError(f"{path} holds a head of method {found!r}, not {method!r}: give a {method} head, "
                               f"or use method {found!r}")
        if method == "eagle3":
            tensors = _eagle3_layers(tensors, directory)
        if method == "eagle":
            _check_eagle_bias(config, tensors, directory)
        ckpt = HeadCheckpoint(method, config, tensors, directory, "medusa" if method == "medusa" else "specforge")
    if method == "eagle3":
        ckpt.config = _check_eagle3_config(ckpt.config, directory)
    return ckpt


def find_method(path: str | Path) -> str:
    """The method of the head in `path` (what `specdec convert-head` converts when --method is not given)."""
    directory, file = head_location(path, "draft")
    gguf = file if file is not None and file.suffix == ".gguf" else _lone_gguf(directory)
    if gguf is not None:
        from gguf import GGUFReader

        arch = GGUFReader(gguf).get_field("general.architecture").contents()
        return "eagle3" if arch == "eagle3" else "mtp"
    directory, config = read_head_config(directory, "draft")
    found = detect_method(config) or detect_method(config, read_head_tensors(directory, "draft", file))
    if found is None:
        raise SpecdecError(f"cannot tell which method the head in {path} is for: pass --method")
    return found


def detect_method(config: dict, tensors: dict[str, torch.Tensor] | None = None) -> str | None:
    """Which method a config (and its tensors) belongs to, None where nothing tells."""
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        return kind if kind in ("eagle3", "eagle") else None
    if "medusa_num_heads" in config or config.get("model_type") == "medusa":
        return "medusa"
    if config.get("num_nextn_predict_layers"):
        return "mtp"
    arch = " ".join(a for a in config.get("architectures") or [] if isinstance(a, str))
    if "Eagle3" in arch or "draft_vocab_size" in config:
        return "eagle3"
    if "MTP" in arch:
        return "mtp"
    if "EagleHead" in arch:
        return "eagle"
    if tensors is not None:
        if any(k.startswith("midlayer.") for k in tensors):
            return "eagle3"
        if any(k.startswith(("medusa_head.", "0.0.linear")) for k in tensors):
            return "medusa"
        if any(".eh_proj." in k or k.startswith("eh_proj.") for k in tensors):
            return "mtp"
        if "fc.weight" in tensors:
            return "eagle"
    return None


def _lone_gguf(directory: Path) -> Path | None:
    """A directory without config.json holding exactly one .gguf: that file."""
    if (directory / "config.json").is_file():
        return None
    ggufs = sorted(directory.glob("*.gguf"))
    return ggufs[0] if len(ggufs) == 1 else None


# ---- EAGLE-3: SpecForge, the EAGLE reference, AngelSlim -------------------------------------------------------
def _check_eagle3_config(config: dict, where: Path) -> dict:
    """Refuse the options of published EAGLE-3 configs that change the computation and that we do not implement;
    `norm_before_fc` is also read from `eagle_config` (as SGLang does)."""
    eagle_config = config.get("eagle_config") or {}
    refused = {"mlp_bias": config.get("mlp_bias"), "use_sliding_window": config.get("use_sliding_window"),
               "eagle_config.use_mtp_layernorm": eagle_config.get("use_mtp_layernorm"),
               "eagle_config.parallel_draft_step": (eagle_config.get("parallel_draft_step") or 1) > 1,
               "eagle_config.use_input_layernorm_in_first_layer":
                   eagle_config.get("use_input_layernorm_in_first_layer") is False,
               "eagle_config.use_last_layernorm": eagle_config.get("use_last_layernorm") is False}
    for key, set_ in refused.items():
        if set_:
            raise SpecdecError(f"EAGLE-3 head {where}: {key} is set, which specdec does not implement")
    if "norm_before_fc" in eagle_config and "norm_before_fc" not in config:
        config = {**config, "norm_before_fc": eagle_config["norm_before_fc"]}
    return config


def _eagle3_layers(tensors: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """Multi-layer reference exports name layer i `midlayer.{i}.*`: the first becomes `midlayer.*`, the others
    `layers.{i}.*` (which must be whole Llama layers)."""
    if not any(re.match(r"midlayer\.\d+\.", k) for k in tensors):
        return tensors
    out = {}
    for name, t in tensors.items():
        m = re.match(r"midlayer\.(\d+)\.(.*)", name)
        out[name if m is None else ("midlayer." if m[1] == "0" else f"layers.{m[1]}.") + m[2]] = t
    if any(k.startswith("layers.") for k in out) and not any(k.endswith("input_layernorm.weight") and
                                                             k.startswith("layers.") for k in out):
        raise SpecdecError(f"EAGLE-3 head {where}: its layers past the first have no input_layernorm (ModelOpt's "
                           "`next_layer_regular` export), which is not implemented")
    return out


def _check_eagle_bias(config: dict, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """The EAGLE reference reads `bias` (default true) for fc: a file must agree with its config."""
    if "bias" in config and bool(config["bias"]) != ("fc.bias" in tensors):
        raise SpecdecError(f"EAGLE head {where}: config.json says bias={config['bias']} but the weights "
                           f"{'lack' if config['bias'] else 'have'} fc.bias")


# ---- vLLM speculators --------------------------------------------------------------------------------------------
_SPECULATORS_META = {"speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
                     "transformer_layer_architecture", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                     "target_hidden_size", "embed_requires_grad", "has_no_defaults_at_init", "auto_map"}
# What transformers' PretrainedConfig writes into every config.json (4.x and 5.x): never a speculators option.
_HF_GENERIC = set("""_name_or_path architectures model_type transformers_version torch_dtype dtype use_cache return_dict
output_hidden_states output_attentions torchscript use_bfloat16 tf_legacy_loss pruned_heads tie_word_embeddings
chunk_size_feed_forward is_encoder_decoder is_decoder cross_attention_hidden_size add_cross_attention
tie_encoder_decoder max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty
temperature top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
encoder_no_repeat_ngram_size bad_words_ids num_return_sequences output_scores return_dict_in_generate
forced_bos_token_id forced_eos_token_id remove_invalid_values exponential_decay_length_penalty suppress_tokens
begin_suppress_tokens finetuning_task id2label label2id tokenizer_class prefix bos_token_id pad_token_id
eos_token_id sep_token_id decoder_start_token_id task_specific_params problem_type""".split())
_SPECULATORS_OPTIONS = {"eagle3": ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"),
                        "eagle": ("layernorms", "fusion_bias")}


def _from_speculators(where: Path, config: dict, tensors: dict[str, torch.Tensor], method: str) -> HeadCheckpoint:
    kind = config["speculators_model_type"]
    if kind not in _SPECULATORS_OPTIONS:
        raise SpecdecError(f"speculators head {where}: speculators_model_type {kind!r} is not one specdec reads "
                           f"(it reads {sorted(_SPECULATORS_OPTIONS)})")
    if kind != method:
        raise SpecdecError(f"{where} is a speculators {kind!r} head, not {method!r}: use method {kind!r}")
    unknown = sorted(k for k, v in config.items() if k not in _SPECULATORS_META | _HF_GENERIC and
                     k not in _SPECULATORS_OPTIONS[kind] and v not in (None, False))
    if unknown:
        raise SpecdecError(f"speculators head {where}: option(s) {unknown} are not implemented")
    layer = dict(config.get("transformer_layer_config") or {})
    if not layer:
        raise SpecdecError(f"speculators head {where}: config.json has no transformer_layer_config")
    if "model_type" not in layer:  # speculators' own default decoder config is Qwen3's
        layer["model_type"] = "qwen3" if any(k.endswith("q_norm.weight") for k in tensors) else "llama"
    if kind == "eagle3":
        return _from_speculators_eagle3(where, config, layer, tensors)
    return _from_speculators_eagle(where, config, layer, tensors)


def _from_speculators_eagle3(where: Path, config: dict, layer: dict, tensors: dict[str, torch.Tensor]
                             ) -> HeadCheckpoint:
    ours = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size":
            config.get("draft_vocab_size") or layer["vocab_size"]}
    for key in (*_SPECULATORS_OPTIONS["eagle3"], "target_hidden_size"):
        if config.get(key):
            ours[key] = config[key]
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids:  # vLLM's sense: the input of layer k, the output of layer k - 1 (k = 0: the embeddings)
        if min(ids) < 1:
            raise SpecdecError(f"speculators head {where} reads the target's embeddings as a feature "
                               f"(eagle_aux_hidden_state_layer_ids {ids} holds 0), which specdec does not gather")
        ours["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in ids]}
    renamed = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: t
               for k, t in tensors.items()}
    return HeadCheckpoint("eagle3", ours, renamed, where, "speculators")


# speculators' EAGLE-1 / HASS names -> the EAGLE reference's (ours)
_SPECULATORS_EAGLE = {"fusion_fc.": "fc.", "transformer.": "layers.0.", "embedding_layernorm.": "enorm.",
                      "pre_lm_head_layernorm.": "norm."}


def _from_speculators_eagle(where: Path, config: dict, layer: dict, tensors: dict[str, torch.Tensor]
                            ) -> HeadCheckpoint:
    renamed = {}
    for name, t in tensors.items():
        prefix = next((p for p in _SPECULATORS_EAGLE if name.startswith(p)), None)
        if prefix is None:
            if name.startswith(("embed_tokens.", "lm_head.", "verifier")):
                continue  # the verifier's own, never saved by speculators: the target's are read
            raise SpecdecError(f"speculators eagle head {where} has tensor {name!r}, which specdec has no place for")
        renamed[_SPECULATORS_EAGLE[prefix] + name[len(prefix):]] = t
    if bool(config.get("fusion_bias")) != ("fc.bias" in renamed):
        raise SpecdecError(f"speculators eagle head {where}: fusion_bias={config.get('fusion_bias')} disagrees "
                           "with its tensors (fusion_fc.bias)")
    return HeadCheckpoint("eagle", {**layer, "num_hidden_layers": 1}, renamed, where, "speculators")


# ---- Medusa: vLLM's converted layout -------------------------------------------------------------------------------
def _from_vllm_medusa(where: Path, config: dict, tensors: dict[str, torch.Tensor], method: str) -> HeadCheckpoint:
    if method != "medusa":
        raise SpecdecError(f"{where} is a Medusa head (model_type medusa), not {method!r}: use method 'medusa'")
    truncated = config.get("truncated_vocab_size")
    if truncated and truncated != config.get("vocab_size"):
        raise SpecdecError(f"Medusa head {where}: truncated_vocab_size={truncated} (a truncated vocabulary with "
                           "a token_map) is not implemented")
    if config.get("original_lm_head"):
        raise SpecdecError(f"Medusa head {where}: original_lm_head=true is not implemented")
    K, L = int(config["num_heads"]), int(config.get("num_hidden_layers", 1))
    renamed = {}
    for name, t in tensors.items():
        name = name.removeprefix("medusa_heads.")
        if m := re.match(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$", name):
            renamed[f"medusa_head.{m[1]}.{m[2]}.linear.{m[3]}"] = t
        elif m := re.match(r"lm_heads\.(\d+)\.weight$", name):
            renamed[f"medusa_head.{m[1]}.{L}.weight"] = t
        else:
            raise SpecdecError(f"Medusa head {where} has tensor {name!r}, which specdec has no place for")
    ours = {"medusa_num_heads": K, "medusa_num_layers": L, "hidden_size": config.get("hidden_size"),
            "vocab_size": config.get("vocab_size")}
    return HeadCheckpoint("medusa", {k: v for k, v in ours.items() if v is not None}, renamed, where, "medusa")


# ---- MTP layers inside a Hugging Face model ------------------------------------------------------------------------
def _mtp_inside(where: Path, config: dict, tensors: dict[str, torch.Tensor]) -> HeadCheckpoint:
    """The first MTP module of a model with `num_nextn_predict_layers` (DeepSeek-V3 / GLM layout: layer ids past
    the main layers); the others would draft later steps, which one module reused does here."""
    first = int(config["num_hidden_layers"])
    prefix = f"model.layers.{first}."
    mine = {k: t for k, t in tensors.items() if k.startswith(prefix)}
    if not mine:
        raise SpecdecError(f"model {where} declares num_nextn_predict_layers={config['num_nextn_predict_layers']} "
                           f"but has no tensors under {prefix!r}")
    head = {k: v for k, v in config.items() if k != "num_nextn_predict_layers"}
    return HeadCheckpoint("mtp", {**head, "num_hidden_layers": 1}, mine, where, "mtp")


# ---- writing ------------------------------------------------------------------------------------------------------
def write_head(ckpt: HeadCheckpoint, fmt: str, out: str | Path, target_gguf: Path | None = None) -> Path:
    """Write `ckpt` in layout `fmt` (one of WRITES[method]) under `out`; returns what was written. `target_gguf`:
    for gguf, the target's file, whose tokenizer llama.cpp needs in the head's."""
    if fmt not in WRITES.get(ckpt.method, ()):
        raise SpecdecError(f"a {ckpt.method} head converts to {list(WRITES.get(ckpt.method, ()))}, not {fmt!r}")
    out = Path(out)
    if fmt == "gguf":
        return write_gguf_head(ckpt, out, target_gguf)
    if target_gguf is not None:
        raise SpecdecError(f"--target is for --to gguf (llama.cpp's heads carry the target's tokenizer); the {fmt} "
                           "layout takes it from the target at load")
    out.mkdir(parents=True, exist_ok=True)
    config, tensors, weights = _layout(ckpt, fmt)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for old in [*out.glob("*.safetensors"), *out.glob("*.bin"), *out.glob("*.pt")]:
        old.unlink()
    tensors = {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
    if weights.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(tensors, out / weights, metadata={"format": "pt"})
    else:
        torch.save(tensors, out / weights)
    return out


def _layout(ckpt: HeadCheckpoint, fmt: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    """(config.json, tensors, weight file name) of `ckpt` in `fmt`."""
    config, tensors = dict(ckpt.config), dict(ckpt.tensors)
    if fmt == "specforge":
        if ckpt.method != "eagle3":
            config["architectures"] = [_OUR_ARCHITECTURES[ckpt.method]]
        return config, tensors, "model.safetensors"
    if fmt == "eagle":  # the reference's pickles under the same names
        if ckpt.method == "eagle":
            config = {**config, "architectures": ["LlamaForCausalLM"], "bias": "fc.bias" in tensors}
        return config, tensors, "pytorch_model.bin"
    if fmt == "medusa":
        K, L = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
        config = {**config, "architectures": ["MedusaModel"], "medusa_num_heads": K, "medusa_num_layers": L}
        return config, {k.removeprefix("medusa_head."): t for k, t in tensors.items()}, "medusa_lm_head.pt"
    return (_to_speculators_eagle3(config, tensors) if ckpt.method == "eagle3"
            else _to_speculators_eagle(config, tensors))


def _to_speculators_eagle3(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict, str]:
    options = {k: bool(config.pop(k, False)) for k in _SPECULATORS_OPTIONS["eagle3"]}
    ids = (config.pop("eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    draft_vocab = config.pop("draft_vocab_size")
    target_hidden = config.pop("target_hidden_size", None)
    config.pop("architectures", None)
    out = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.1.0",
           "transformer_layer_config": config, "draft_vocab_size": draft_vocab, **options,
           "target_hidden_size": target_hidden,
           "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in ids] if ids else None,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": None, "architectures": []}}}
    renamed = {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: t for k, t in tensors.items()}
    return out, renamed, "model.safetensors"


def _to_speculators_eagle(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict, str]:
    if "hnorm.weight" in tensors or ("enorm.weight" in tensors) != ("norm.weight" in tensors):
        raise SpecdecError("speculators' eagle layout has the embedding and output norms together or neither, "
                           "and no hidden-state norm: this head does not fit it")
    theirs = {v: k for k, v in _SPECULATORS_EAGLE.items()}
    if any(re.match(r"layers\.[1-9]", k) for k in tensors):
        raise SpecdecError("speculators' eagle layout holds one decoder layer: this head has more")
    renamed = {next(theirs[p] + k[len(p):] for p in theirs if k.startswith(p)): t for k, t in tensors.items()}
    layernorms = "enorm.weight" in tensors
    config.pop("architectures", None)
    out = {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"], "speculators_model_type": "eagle",
           "speculators_version": "0.1.0", "transformer_layer_config": {**config, "num_hidden_layers": 1},
           "transformer_layer_architecture": "LlamaDecoderLayer", "layernorms": layernorms,
           "fusion_bias": "fc.bias" in tensors,
           "speculators_config": {"algorithm": "eagle", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": None, "architectures": []}}}
    return out, renamed, "model.safetensors"
