"""A CTranslate2 Whisper model (faster-whisper's folder: ``model.bin``, ``config.json``,
``tokenizer.json``) rewritten as a transformers Whisper folder, which the OpenVINO exporter takes.

``model.bin`` is CTranslate2's binary format (version 6 read here): a header, then each variable as
name, rank, shape, data type and raw little-endian bytes, then aliases. Its attention projections
are fused (self-attention q|k|v, cross-attention k|v; Whisper's key projection has no bias, stored
as zeros) and are split back into transformers' names.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

#: CTranslate2's data type ids (``ctranslate2::DataType``).
_DTYPES: dict[int, Any] = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
_NORMS = {"gamma": "weight", "beta": "bias"}


class NotCTranslate2(ValueError):
    """The file is not a CTranslate2 Whisper model this reader takes (the message says why)."""


def read_model_bin(path: Path) -> dict[str, np.ndarray]:
    """The variables of a CTranslate2 ``model.bin`` by name (aliases resolved), as read-only
    views over the file's bytes. NotCTranslate2 for another format or spec, or an int8 model."""
    data = path.read_bytes()
    offset = 0

    def take(fmt: str) -> Any:
        nonlocal offset
        value = struct.unpack_from(fmt, data, offset)[0]
        offset += struct.calcsize(fmt)
        return value

    def text() -> str:
        nonlocal offset
        size = take("<H")
        value = data[offset:offset + size - 1].decode()
        offset += size
        return value

    try:
        version = take("<I")
        if not 3 <= version <= 6:
            raise NotCTranslate2(f"{path}: CTranslate2 format version {version} is not read (3 to 6 are)")
        spec = text()
        if spec != "WhisperSpec":
            raise NotCTranslate2(f"{path} holds a {spec!r} model, not Whisper")
        take("<I")  # the spec's revision
        variables: dict[str, np.ndarray] = {}
        for _ in range(take("<I")):
            name = text()
            shape = [take("<I") for _ in range(take("<B"))]
            dtype = _DTYPES.get(take("<B"))
            size = take("<I")
            if dtype is None or (dtype is np.int8 and shape):
                raise NotCTranslate2(f"{path}: {name} is quantized; convert the model with float16 or float32 "
                                     "weights (ct2-transformers-converter --quantization float16)")
            variables[name] = np.frombuffer(data, dtype, size // np.dtype(dtype).itemsize, offset).reshape(shape)
            offset += size
        for _ in range(take("<I")):
            alias, target = text(), text()
            variables[alias] = variables[target]
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, NotCTranslate2):
            raise
        raise NotCTranslate2(f"{path} is not a CTranslate2 model file: {exc}") from None
    return variables


def _layers(variables: dict[str, np.ndarray], side: str) -> int:
    return len({name.split("/")[1] for name in variables if re.match(rf"{side}/layer_\d+/", name)})


def state_dict(variables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' ``WhisperForConditionalGeneration`` weights of CTranslate2's variables."""
    out: dict[str, np.ndarray] = {}

    def norm(src: str, dst: str) -> None:
        for ours, theirs in _NORMS.items():
            out[f"{dst}.{theirs}"] = variables[f"{src}/{ours}"]

    def linear(src: str, dst: str) -> None:
        out[f"{dst}.weight"] = variables[f"{src}/weight"]
        out[f"{dst}.bias"] = variables[f"{src}/bias"]

    def fused(src: str, dsts: list[str]) -> None:
        weights = np.split(variables[f"{src}/weight"], len(dsts))
        biases = np.split(variables[f"{src}/bias"], len(dsts))
        for dst, weight, bias in zip(dsts, weights, biases, strict=True):
            out[f"{dst}.weight"] = weight
            if not dst.endswith("k_proj"):  # Whisper's key projections have no bias
                out[f"{dst}.bias"] = bias

    for side in ("encoder", "decoder"):
        for i in range(_layers(variables, side)):
            src, dst = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            attn = f"{dst}.self_attn"
            norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
            fused(f"{src}/self_attention/linear_0", [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"])
            linear(f"{src}/self_attention/linear_1", f"{attn}.out_proj")
            if side == "decoder":
                cross = f"{dst}.encoder_attn"
                norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
                linear(f"{src}/attention/linear_0", f"{cross}.q_proj")
                fused(f"{src}/attention/linear_1", [f"{cross}.k_proj", f"{cross}.v_proj"])
                linear(f"{src}/attention/linear_2", f"{cross}.out_proj")
            norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")
            linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
            linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
        norm(f"{side}/layer_norm", f"model.{side}.layer_norm")
        out[f"model.{side}.embed_positions.weight"] = variables[f"{side}/position_encodings/encodings"]
    for conv in ("conv1", "conv2"):
        linear(f"encoder/{conv}", f"model.encoder.{conv}")
    out["model.decoder.embed_tokens.weight"] = variables["decoder/embeddings/weight"]
    return out


def _token_ids(tokenizer: dict[str, Any]) -> dict[str, int]:
    return {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}


def configs(variables: dict[str, np.ndarray], ct2_config: dict[str, Any],
            tokenizer: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config.json, generation_config.json)`` of the transformers folder."""
    ids = _token_ids(tokenizer)
    vocab, d_model = variables["decoder/embeddings/weight"].shape
    eot = ids["<|endoftext|>"]
    start = ids["<|startoftranscript|>"]
    multilingual = "<|en|>" in ids and len(ct2_config.get("lang_ids", [])) > 1
    by_id = {v: k for k, v in ids.items()}
    heads = int(variables["encoder/num_heads"])
    config = {
        "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper", "vocab_size": int(vocab),
        "num_mel_bins": int(variables["encoder/conv1/weight"].shape[1]), "d_model": int(d_model),
        "encoder_layers": _layers(variables, "encoder"), "decoder_layers": _layers(variables, "decoder"),
        "encoder_attention_heads": heads, "decoder_attention_heads": int(variables["decoder/num_heads"]),
        "encoder_ffn_dim": int(variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "decoder_ffn_dim": int(variables["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "max_source_positions": int(variables["encoder/position_encodings/encodings"].shape[0]),
        "max_target_positions": int(variables["decoder/position_encodings/encodings"].shape[0]),
        "activation_function": "gelu", "scale_embedding": False, "tie_word_embeddings": True,
        "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot, "decoder_start_token_id": start,
        "begin_suppress_tokens": ct2_config.get("suppress_ids_begin", [220, eot]),
        "torch_dtype": "float16",
    }
    generation = {
        "alignment_heads": ct2_config.get("alignment_heads", []),
        "begin_suppress_tokens": config["begin_suppress_tokens"],
        "bos_token_id": eot, "decoder_start_token_id": start, "eos_token_id": eot, "pad_token_id": eot,
        "is_multilingual": multilingual, "max_length": config["max_target_positions"],
        "max_initial_timestamp_index": 50, "no_timestamps_token_id": ids["<|notimestamps|>"],
        "prev_sot_token_id": ids.get("<|startofprev|>"), "return_timestamps": False,
        "suppress_tokens": ct2_config.get("suppress_ids", []),
    }
    if multilingual:
        generation["lang_to_id"] = {by_id[i]: i for i in ct2_config["lang_ids"] if i in by_id}
        generation["task_to_id"] = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
        generation["forced_decoder_ids"] = [[1, None], [2, ids["<|transcribe|>"]]]
    else:
        generation["forced_decoder_ids"] = [[1, ids["<|notimestamps|>"]]]
    return config, generation


def to_transformers(source: Path, target: Path) -> None:
    """Write the transformers folder of the CTranslate2 folder ``source`` into ``target``
    (``model.safetensors``, the configs, the tokenizer and the feature extractor's settings)."""
    import torch
    from safetensors.torch import save_file
    from transformers import WhisperFeatureExtractor

    variables = read_model_bin(source / "model.bin")
    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    ct2_config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config, generation = configs(variables, ct2_config, tokenizer)
    target.mkdir(parents=True, exist_ok=True)
    tensors = {name: torch.from_numpy(np.array(value)) for name, value in state_dict(variables).items()}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    (target / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    specials = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>"}
    (target / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "WhisperTokenizer", "model_max_length": 1024, "add_prefix_space": False,
         "errors": "replace", **specials}, indent=2), encoding="utf-8")
    (target / "special_tokens_map.json").write_text(json.dumps(specials, indent=2), encoding="utf-8")
    extractor = WhisperFeatureExtractor(feature_size=config["num_mel_bins"])
    extractor.save_pretrained(str(target))
