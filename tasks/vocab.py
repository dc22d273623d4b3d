"""Single-nucleotide DNA vocabulary shared by the shards, the trainer and the inference engines.

Token ids (uint8 in the shards):

    ====  =========  ==========================================================
    id    token      meaning
    ====  =========  ==========================================================
    0     ``<pad>``  padding (never in shards; batches only)
    1     ``<sep>``  document separator between joined records / N-split pieces
    2     ``<bos>``  beginning of sequence (prompts of the RL and verify stages)
    3     ``<unk>``  unknown (never produced by packing: bad characters are errors)
    4-7   A C G T    bases; lowercase (soft-masked) input maps to the same ids
    8     N          any IUPAC ambiguity code (N R Y S W K M B D H V) and N itself
    ====  =========  ==========================================================

The vocabulary is written as a Hugging Face ``tokenizer.json`` (a character-level
``WordLevel`` model) so that transformers and vLLM load exactly these ids. A pretrained
checkpoint with its own ids for the single letters is used through :func:`id_map_to`, a
256-entry lookup applied when shards are loaded; the shards themselves always hold the ids
above.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

PAD, SEP, BOS, UNK = 0, 1, 2, 3
A, C, G, T, N = 4, 5, 6, 7, 8
#: the ids a policy may emit when it continues DNA (RL rollouts sample only these)
ACGT = (A, C, G, T)
SPECIAL_TOKENS = ("<pad>", "<sep>", "<bos>", "<unk>")
BASE_TOKENS = ("A", "C", "G", "T", "N")
TOKENS = SPECIAL_TOKENS + BASE_TOKENS
VOCAB_SIZE = len(TOKENS)

# FASTA bytes that are valid DNA: IUPAC nucleotide codes (U read as T), either case.
IUPAC_DNA = b"ACGTUNRYSWKMBDHVacgtunryswkmbdhv"

#: uint8[256]: FASTA byte -> token id; 255 for bytes that are not IUPAC DNA.
BYTE_TO_TOKEN = np.full(256, 255, dtype=np.uint8)
for _byte in IUPAC_DNA:
    BYTE_TO_TOKEN[_byte] = N
for _letters, _id in ((b"Aa", A), (b"Cc", C), (b"Gg", G), (b"TtUu", T)):
    for _byte in _letters:
        BYTE_TO_TOKEN[_byte] = _id

#: bool[256]: FASTA byte is soft-masked (lowercase).
BYTE_IS_SOFTMASKED = np.zeros(256, dtype=bool)
BYTE_IS_SOFTMASKED[list(b"acgtunryswkmbdhv")] = True

#: uint8[VOCAB_SIZE]: token id -> id of its reverse complement (specials map to themselves).
COMPLEMENT = np.arange(VOCAB_SIZE, dtype=np.uint8)
COMPLEMENT[[A, C, G, T]] = [T, G, C, A]

#: bytes: token id -> the letter decoding produces ('' for specials except <sep> -> '|').
DECODE = np.frombuffer(b"\x00|\x00\x00ACGTN", dtype=np.uint8)


def tokenize(seq: bytes) -> np.ndarray:
    """Map FASTA sequence bytes to token ids.

    Args:
        seq: sequence bytes, no line breaks (any case; IUPAC codes become N).

    Returns:
        uint8 array of shape ``[len(seq)]``.

    Raises:
        ValueError: a byte is not an IUPAC DNA code (the caller names file and record).
    """
    ids = BYTE_TO_TOKEN[np.frombuffer(seq, dtype=np.uint8)]
    if (ids == 255).any():
        bad = seq[int(np.argmax(ids == 255))]
        raise ValueError(f"character {chr(bad)!r} is not an IUPAC DNA code")
    return ids


def decode(ids: np.ndarray) -> str:
    """Token ids (bases only) -> uppercase sequence string; specials are rejected."""
    ids = np.asarray(ids, dtype=np.uint8)
    if ids.size and ids.min() < A:
        raise ValueError("decode() takes base tokens only; drop <sep>/<bos> first")
    return DECODE[ids].tobytes().decode("ascii")


def tokenizer_json() -> dict:
    """The vocabulary as a Hugging Face ``tokenizers`` JSON document (character level)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    vocab = {token: i for i, token in enumerate(TOKENS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    iupac_to_n = [normalizers.Replace(Regex("[RYSWKMBDHVryswkmbdhvn]"), "N"), normalizers.Replace(Regex("[Uu]"), "T")]
    tok.normalizer = normalizers.Sequence(
        iupac_to_n + [normalizers.Replace(lower, lower.upper()) for lower in "acgt"]
    )
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return json.loads(tok.to_str())


def write_tokenizer(out_dir: str | os.PathLike) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` loadable by ``AutoTokenizer``.

    Returns:
        Path of the written ``tokenizer.json``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    path.write_text(json.dumps(tokenizer_json(), indent=1, sort_keys=True))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "eos_token": "<sep>",
        "bos_token": "<bos>",
        "unk_token": "<unk>",
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    return path


def id_map_to(target_tokenizer_json: str | os.PathLike) -> np.ndarray:
    """Lookup table from megabase ids to a pretrained checkpoint's ids for the same letters.

    Applied at load time (``target_ids = table[shard_tokens]``); shards are never rewritten.
    Specials map to the checkpoint's ``<pad>``/``<sep>``/``<bos>``/``<unk>`` equivalents when
    present (``[PAD]``, ``</s>``, ``<s>``, ``[UNK]`` and the like are recognised).

    Args:
        target_tokenizer_json: path of the checkpoint's ``tokenizer.json``.

    Returns:
        int64 array of shape ``[VOCAB_SIZE]``.

    Raises:
        ValueError: a base letter (A, C, G, T, N) has no single-token id in the target vocab.
    """
    doc = json.loads(Path(target_tokenizer_json).read_text())
    vocab = dict(doc["model"]["vocab"]) if isinstance(doc["model"]["vocab"], dict) else {}
    vocab.update({t["content"]: t["id"] for t in doc.get("added_tokens", [])})
    aliases = {
        "<pad>": ("<pad>", "[PAD]", "<|pad|>"),
        "<sep>": ("<sep>", "[SEP]", "</s>", "<eos>", "<|endoftext|>"),
        "<bos>": ("<bos>", "[CLS]", "<s>", "[BOS]"),
        "<unk>": ("<unk>", "[UNK]"),
    }
    table = np.zeros(VOCAB_SIZE, dtype=np.int64)
    for i, token in enumerate(TOKENS):
        candidates = aliases.get(token, (token, token.lower()))
        found = next((vocab[c] for c in candidates if c in vocab), None)
        if found is None and token in BASE_TOKENS:
            raise ValueError(f"{target_tokenizer_json}: no token for base {token!r} in the target vocabulary")
        table[i] = found if found is not None else vocab.get("<unk>", 0)
    return table
