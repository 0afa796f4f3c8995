"""convert_gguf: a GGUF file -> an ONNX Runtime GenAI model folder (exact weights, no re-quantization).

No onnxruntime import.
"""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from engine.builder.errors import BuildError, UnsupportedTokenizerError
from engine.builder.external import ExternalData
from engine.builder.folder import check_target, write_model_folder
from engine.builder.gguf_reader import GGUFModel, open_gguf
from engine.builder.graph import DTYPES, build_graph
from engine.builder.tokenizer import SpecialTokens, build_bpe_tokenizer, build_spm_tokenizer, tokenizer_config
from engine.end_of_generation import eog_token_ids

DEFAULT_MAX_LENGTH = 2048  # search.max_length (the KV buffer length) unless asked otherwise


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    accuracy_level: int = 4,
    dtype: str = "float32",
    overwrite: bool = False,
    progress: bool = True,
    max_length: int | None = None,
    max_layers: int | None = None,
    marker: dict | None = None,
    kv_dtype: str | None = None,
    exact_scales: bool = False,
    requant: str | None = None,
) -> Path:
    """Converts a llama-like GGUF into a model folder (docs/ARCHITECTURE.md layout).

    Args:
        gguf_path: the .gguf file (llama, qwen2 or gemma architecture; F32/F16/BF16/Q4_0/Q4_1/Q8_0).
        out_dir: the folder to create; written atomically.
        accuracy_level: MatMulNBits accuracy level: 4 (int8 activations, fast on CPU) or 0 (exact).
        dtype: activation/KV dtype, "float32" (CPU) or "float16" (GPUs); logits stay float32.
        overwrite: replace ``out_dir`` if it exists (only after the new folder is complete).
        progress: show a tqdm bar over tensors.
        max_length: search.max_length, the KV buffer length (default min(context_length, 2048)).
        max_layers: keep only the first N decoder blocks (for tests).
        marker: cache bookkeeping written last into the folder (see folder.write_model_folder).
        kv_dtype: the KV cache's dtype when not ``dtype`` (float16 KV beside float32 activations halves the KV).
        exact_scales: float16 only: keep K-quant linears in float32 (exact scales) instead of rounding their scales
            to float16 (the default, the GPUs' fast path; engine.builder.graph).
        requant: "q4_0": every linear stored in more than 4 bits (Q5_0, Q8_0, Q6_K, float, ...) requantized as
            llama.cpp's Q4_0 (engine.builder.quant.to_q4_0): lossy, for a draft model (``--draft-quant``), whose
            4-bit weights read half the bytes. None (the default): every value exact.
    Returns:
        The folder, resolved.
    Raises:
        BuildError subclasses (bad GGUF, unsupported architecture/type/tokenizer, existing output).
    """
    if dtype not in DTYPES or (kv_dtype is not None and kv_dtype not in DTYPES):
        raise BuildError(f"dtype and kv_dtype must be one of {tuple(DTYPES)}, got {dtype!r} and {kv_dtype!r}")
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise BuildError(f"accuracy_level must be in 0..4, got {accuracy_level}")
    out_dir = Path(out_dir)
    check_target(out_dir.resolve(), overwrite)
    model = open_gguf(gguf_path, max_layers=max_layers)
    tok, special = gguf_tokenizer(model)
    spec = model.spec
    max_len = min(spec.context_length, max_length or DEFAULT_MAX_LENGTH)

    tok_cfg = tokenizer_config(tok, special, chat_template=model.tokenizer.chat_template,
                               model_max_length=spec.context_length, add_bos=model.tokenizer.add_bos)
    tensors = model.converted_tensors()
    num_tensors = len(tensors)
    # NOTE(builder): the bar counts the GGUF's bytes read, and the tensors; the tied LM head reads the embedding twice
    total_bytes = sum(t.data.nbytes for t in tensors)
    done = {"tensors": 0}
    with tqdm(total=total_bytes, desc=f"converting {model.path.name}", unit="B", unit_scale=True, unit_divisor=1024,
              disable=not progress) as bar:
        def on_tensor(name: str) -> None:
            done["tensors"] = min(num_tensors, done["tensors"] + 1)
            bar.update(min(model.tensors[name].data.nbytes, bar.total - bar.n))
            bar.set_postfix_str(f"{done['tensors']}/{num_tensors} tensors", refresh=False)

        def build(data: ExternalData):
            # 1. Each tensor is converted when the graph reaches it, written to the data file, and dropped.
            return build_graph(spec, model.stream_weights(on_tensor, requant), dtype=dtype, accuracy_level=accuracy_level,
                               data=data, kv_dtype=kv_dtype, exact_scales=exact_scales)

        return write_model_folder(out_dir, build, spec, tok, special, tok_cfg, max_length=max_len,
                                  overwrite=overwrite, marker=marker, embedding_pooling=model.pooling)


def gguf_tokenizer(model: GGUFModel):
    """The GGUF's tokenizer as a tokenizers.Tokenizer plus its special token ids (the end-of-generation set too).

    "gpt2" (byte-level BPE with llama.cpp's pre-tokenizers) and "llama" (SentencePiece) vocabularies.
    """
    meta = model.tokenizer
    if meta.model == "gpt2":
        tok = build_bpe_tokenizer(meta.tokens, meta.merges, meta.token_types, pre=meta.pre, bos_id=meta.bos_id,
                                  add_bos=meta.add_bos)
    elif meta.model == "llama":
        tok = build_spm_tokenizer(meta.tokens, meta.scores, meta.token_types, bos_id=meta.bos_id,
                                  eos_id=meta.eos_id, add_bos=meta.add_bos, add_eos=meta.add_eos,
                                  add_space_prefix=meta.add_space_prefix,
                                  rstrip_specials=any(k in model.name.lower() for k in ("phi-3", "phi3")))
    else:
        raise UnsupportedTokenizerError(
            f"{model.path}: tokenizer.ggml.model {meta.model!r} is not supported "
            f"(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    eog = eog_token_ids(tok.get_vocab(with_added_tokens=True), eos_ids=(meta.eos_id,), eot_id=meta.eot_id,
                        eom_id=meta.eom_id, fim_pad_id=meta.fim_ids[0], fim_rep_id=meta.fim_ids[1],
                        fim_sep_id=meta.fim_ids[2], vocab_size=len(meta.tokens))
    return tok, SpecialTokens(meta.bos_id, meta.eos_id, meta.pad_id, eog_ids=tuple(sorted(eog)))
