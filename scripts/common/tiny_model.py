"""A tiny random-weight Llama and a locally trained tokenizer, made offline.

Deterministic: the same directory content on every machine (seeded weights, a
fixed training corpus). No model hub, no downloads. Used by the demo, the
tests and the benchmarks. About 7 MB.

Shape: hidden 256, 2 layers, 4 heads of 64 (the CPU attention backend
refuses head_dim 16), 2 KV heads, vocabulary 1024, float32.

``ensure_second_model()`` makes another one for trying the tools on a model
they were not written around: a Unigram tokenizer (Metaspace, NFKC, a
small vocabulary of another corpus: several tokens per word), another chat
template and another shape (hidden 384, 3 layers, 6 heads, 3 KV heads,
tied embeddings).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 1024
MAX_POSITIONS = 4096
_STAMP = "tiny-llama-v1"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _corpus() -> list[str]:
    words = (
        "the engine schedules tokens for every user in each step and a user "
        "with many streams shares one budget of output tokens per second "
        "throttled requests keep their cache while others run the scheduler "
        "charges one token when a step samples and refunds it when the "
        "request was not dispatched explain continuous batching in simple words "
        "prefill decode chunk cache block preempt wake queue rate limit spacing"
    ).split()
    lines = []
    for i in range(400):
        n = 6 + (i * 7) % 13
        lines.append(" ".join(words[(i * 3 + j * 5) % len(words)] for j in range(n)))
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_model(out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)


def cache_dir() -> Path:
    """Where the tools keep what they generate when not told otherwise
    (``$XDG_CACHE_HOME/vllm-output-rate``, else ``~/.cache/vllm-output-rate``):
    the same from any working directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-output-rate"


def default_model_dir() -> Path:
    return cache_dir() / "tiny-llama"


@contextlib.contextmanager
def _building(out: Path) -> Iterator[None]:
    """One process at a time builds ``out`` (two test workers, or a demo
    beside a test run, may ask for the same model at once)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _is_built(out: Path, want: str) -> bool:
    stamp = out / "vllm_output_rate_stamp.json"
    return stamp.exists() and json.loads(stamp.read_text()).get("stamp") == want


def ensure_tiny_model(out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Create the model in ``out_dir`` (default: ``default_model_dir()``)
    unless it is already there."""
    out = Path(out_dir) if out_dir is not None else default_model_dir()
    if _is_built(out, _STAMP):
        return out
    with _building(out):
        if not _is_built(out, _STAMP):
            out.mkdir(parents=True, exist_ok=True)
            build_tokenizer(out)
            build_model(out)
            (out / "vllm_output_rate_stamp.json").write_text(json.dumps({"stamp": _STAMP}))
    return out


_SECOND_STAMP = "second-llama-v1"


def build_second_model(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
             "omicron pi rho sigma tau upsilon phi chi psi omega rate limit engine "
             "scheduler token stream user budget").split()
    corpus = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 11))
              for i in range(2000)]
    corpus.append("".join(chr(c) for c in range(32, 127)))
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=3000, unk_token="<unk>", show_progress=False,
                                      special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"])
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<eos>"
                          "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    fast.save_pretrained(str(out))
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=384, intermediate_size=768, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=2048, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True, dtype="float32")
    torch.manual_seed(1)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(str(out), safe_serialization=True)


def ensure_second_model(out_dir: str | os.PathLike[str] | None = None) -> Path:
    """The second model in ``out_dir`` (default: beside the tiny one)."""
    out = Path(out_dir) if out_dir is not None else cache_dir() / "second-llama"
    if _is_built(out, _SECOND_STAMP):
        return out
    with _building(out):
        if not _is_built(out, _SECOND_STAMP):
            out.mkdir(parents=True, exist_ok=True)
            build_second_model(out)
            (out / "vllm_output_rate_stamp.json").write_text(json.dumps({"stamp": _SECOND_STAMP}))
    return out


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    if args and args[0] == "--second":
        print(ensure_second_model(args[1] if len(args) > 1 else None))
    else:
        print(ensure_tiny_model(args[0] if args else None))
