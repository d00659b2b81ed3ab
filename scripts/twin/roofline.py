"""The twin's step-time model estimated from a model's config and a named
GPU (a roofline: ``vllm-output-rate twin calibrate --model DIR --gpu NAME
--out FILE``, ``"source": "estimate"``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_output_rate.tools.twin.step_time import VERSION, CalibrationError



#: name -> (memory bandwidth GB/s, dense BF16/FP16 tensor TFLOP/s). From the
#: vendors' datasheets: NVIDIA H100 SXM5 and PCIe, H200 SXM, A100 SXM4 80GB and
#: 40GB, L40S, L4, A10, T4 (FP16 with FP32 accumulate); AMD Instinct MI300X.
#: Dense figures (without structured sparsity).
GPUS: dict[str, tuple[float, float]] = {
    "h200": (4800, 989),
    "h100": (3350, 989),
    "h100-pcie": (2000, 756),
    "a100": (2039, 312),
    "a100-40gb": (1555, 312),
    "l40s": (864, 362),
    "l4": (300, 121),
    "a10": (600, 125),
    "t4": (320, 65),
    "mi300x": (5300, 1307),
}
#: Fractions of the datasheet figures a serving engine reaches (assumed, not
#: measured): memory bandwidth of a weight-streaming decode, tensor FLOPs of
#: a large GEMM, and a fixed cost of a step (scheduling, launches, sampling).
BANDWIDTH_EFFICIENCY = 0.8
FLOPS_EFFICIENCY = 0.5
STEP_OVERHEAD_S = 0.002

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
                "float8": 1, "fp8": 1, "int8": 1}


def model_shapes(config: dict[str, Any]) -> dict[str, Any]:
    """Parameters (all, and active per token for a mixture of experts) and
    KV bytes per token, from a Hugging Face ``config.json``'s shapes."""
    cfg = dict(config.get("text_config") or {}, **{k: v for k, v in config.items()
                                                   if k != "text_config"}) \
        if "hidden_size" not in config and "text_config" in config else config
    try:
        h = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CalibrationError(f"config.json: {exc}: missing or not a number "
                               f"(a decoder's hidden_size, num_hidden_layers, "
                               f"num_attention_heads, vocab_size)") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    inter = int(cfg.get("intermediate_size") or 4 * h)
    gated = cfg.get("hidden_act", "silu") in ("silu", "swiglu", "gelu_pytorch_tanh") \
        or cfg.get("model_type") in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    mlp_one = (3 if gated else 2) * h * int(cfg.get("moe_intermediate_size") or inter)
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    per_tok = int(cfg.get("num_experts_per_tok") or 0)
    if experts and per_tok:
        mlp_all, mlp_active = experts * mlp_one, per_tok * mlp_one
    else:
        mlp_all = mlp_active = (3 if gated else 2) * h * inter
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    nbytes = _DTYPE_BYTES.get(dtype, 2)
    return {"params": layers * (attn + mlp_all) + embed,
            "active_params": layers * (attn + mlp_active) + embed,
            "bytes_per_param": nbytes,
            "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * nbytes,
            "layers": layers, "hidden_size": h, "dtype": dtype}


def roofline_estimate(model_dir: str, gpu: str) -> dict[str, Any]:
    """The step-time JSON of a roofline estimate (``"source": "estimate"``):
    every step streams the weights once (``base_s``), each token computed
    costs 2 x active parameters FLOPs (``per_decode_s``,
    ``per_prefill_token_s``), each token of context is read from the KV
    cache (``per_context_token_s``). Memory and compute times are summed (a
    linear model; the true roofline takes the larger of the two)."""
    name = gpu.lower()
    if name not in GPUS:
        raise CalibrationError(f"--gpu {gpu}: not known (known: {', '.join(GPUS)})")
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise CalibrationError(f"{path}: not JSON ({exc})") from None
    shapes = model_shapes(config)
    bw = GPUS[name][0] * 1e9 * BANDWIDTH_EFFICIENCY
    flops = GPUS[name][1] * 1e12 * FLOPS_EFFICIENCY
    per_token = 2 * shapes["active_params"] / flops
    terms = {
        "base_s": STEP_OVERHEAD_S + shapes["params"] * shapes["bytes_per_param"] / bw,
        "per_decode_s": per_token,
        "per_prefill_token_s": per_token,
        "per_context_token_s": shapes["kv_bytes_per_token"] / bw,
    }
    note = (f"roofline estimate: {name} ({GPUS[name][0]:g} GB/s, {GPUS[name][1]:g} TFLOP/s "
            f"dense, at {BANDWIDTH_EFFICIENCY:g} and {FLOPS_EFFICIENCY:g} of them), "
            f"{shapes['params'] / 1e9:.3g}B parameters ({shapes['active_params'] / 1e9:.3g}B "
            f"active) in {shapes['dtype']}, {STEP_OVERHEAD_S * 1e3:g} ms a step of overhead")
    return {"version": VERSION, "kind": "linear",
            **{k: float(f"{v:.6g}") for k, v in terms.items()},
            "source": "estimate", "note": note, "estimate": {"gpu": name, **shapes}}
