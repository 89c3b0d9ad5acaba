"""The tokenizer: BPE with 8192 tokens trained with rustbpe, served by tiktoken, stored as plain JSON
(never a pickle) and pinned by its SHA-256."""
from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import tiktoken
import torch

from harness.common import TokenizerError, atomic_write_bytes, atomic_write_json, log, sha256_file
from harness.config import (BOS_TOKEN, SHIPPED_TOKENIZER_DIR, SHIPPED_TOKENIZER_PINS, SPECIAL_TOKENS, SPLIT_PATTERN,
                            TOKENIZER_VOCAB_SIZE, env_setting)
from harness.data import SHARD_NAME, active_dataset_dir, dataset_name, load_manifest, split_shards

TOKENIZER_FORMAT = "trainium-frontier-bpe/1"
TOKENIZER_TRAIN_MAX_CHARS = 1_000_000_000  # characters of training text the BPE sees at most
TOKENIZER_TRAIN_DOC_CAP = 10_000  # characters taken from one document at most
TOKENIZER_CLIMBMIX_SHARDS = 8  # ClimbMix tokenizer: trained from shards 0..7 only, so every build agrees


class Tokenizer:
    """tiktoken Encoding plus the kit's special tokens. Build it with ensure_tokenizer()."""

    def __init__(self, enc: tiktoken.Encoding, name: str, path: Path, sha256: str):
        self.enc, self.name, self.path, self.sha256 = enc, name, path, sha256
        self.bos_token_id = enc.encode_single_token(BOS_TOKEN)

    @classmethod
    def from_file(cls, path: Path, sha256: str) -> "Tokenizer":
        try:
            data = json.loads(path.read_bytes())
            if data.get("format") != TOKENIZER_FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {TOKENIZER_FORMAT!r}")
            ranks = {base64.b64decode(tok): rank for rank, tok in enumerate(data["merges_b64"])}
            enc = tiktoken.Encoding(name=data["name"], pat_str=data["pattern"], mergeable_ranks=ranks,
                                    special_tokens={k: int(v) for k, v in data["special_tokens"].items()})
        except Exception as e:
            raise TokenizerError(f"{path} is not a valid tokenizer file ({type(e).__name__}: {e})")
        if enc.n_vocab != TOKENIZER_VOCAB_SIZE or set(data["special_tokens"]) != set(SPECIAL_TOKENS):
            raise TokenizerError(f"{path} has {enc.n_vocab} tokens and special tokens {sorted(data['special_tokens'])}; "
                                 f"the competition uses {TOKENIZER_VOCAB_SIZE} tokens and {list(SPECIAL_TOKENS)}")
        return cls(enc, data["name"], path, sha256)

    def get_vocab_size(self) -> int:
        return self.enc.n_vocab

    def get_bos_token_id(self) -> int:
        return self.bos_token_id

    def encode_special(self, text: str) -> int:
        return self.enc.encode_single_token(text)

    def encode(self, text, prepend=None, num_threads: int = 8):
        """Ordinary text to ids (special-token strings in the text are treated as text). `prepend`
        (an id or a special-token string) goes in front of every sequence."""
        if prepend is not None and not isinstance(prepend, int):
            prepend = self.encode_special(prepend)
        if isinstance(text, str):
            ids = self.enc.encode_ordinary(text)
            return ids if prepend is None else [prepend] + ids
        if isinstance(text, (list, tuple)):
            rows = self.enc.encode_ordinary_batch(list(text), num_threads=num_threads)
            if prepend is not None:
                for row in rows:
                    row.insert(0, prepend)
            return rows
        raise TypeError(f"encode takes a str or a list of str, got {type(text).__name__}")

    def decode(self, ids) -> str:
        return self.enc.decode(list(ids))

    def token_byte_lengths(self) -> list[int]:
        """UTF-8 byte length of every token id; 0 for special tokens (they are not text)."""
        special = set(self.enc.special_tokens_set)
        lengths = []
        for i in range(self.enc.n_vocab):
            token = self.enc.decode_single_token_bytes(i)
            lengths.append(0 if token.decode("utf-8", errors="replace") in special else len(token))
        return lengths


def serialize_tokenizer(mergeable_ranks: list[tuple[bytes, int]], pattern: str, name: str, provenance: dict) -> bytes:
    """The plain, non-executable artifact: JSON with the merges in rank order, base64-encoded."""
    ordered = sorted(mergeable_ranks, key=lambda kv: kv[1])
    if [r for _, r in ordered] != list(range(len(ordered))):
        raise TokenizerError("BPE ranks are not 0..n-1")
    specials = {tok: len(ordered) + i for i, tok in enumerate(SPECIAL_TOKENS)}
    data = {"format": TOKENIZER_FORMAT, "name": name, "pattern": pattern, "special_tokens": specials,
            "vocab_size": len(ordered) + len(SPECIAL_TOKENS), "trained_on": provenance,
            "merges_b64": [base64.b64encode(bytes(tok)).decode("ascii") for tok, _ in ordered]}
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()


def train_tokenizer(texts, name: str, provenance: dict) -> bytes:
    """Train the BPE on an iterable of texts; deterministic for the same texts in the same order."""
    import rustbpe  # only needed to build a tokenizer
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator(iter(texts), TOKENIZER_VOCAB_SIZE - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
    ranks = [(bytes(k), v) for k, v in bpe.get_mergeable_ranks()]
    if len(ranks) + len(SPECIAL_TOKENS) != TOKENIZER_VOCAB_SIZE:
        raise TokenizerError(f"BPE training reached only {len(ranks)} merges of {TOKENIZER_VOCAB_SIZE - len(SPECIAL_TOKENS)}: "
                             f"the training text is too small ({provenance.get('chars', '?')} characters)")
    return serialize_tokenizer(ranks, bpe.get_pattern(), name, provenance)


def _tokenizer_training_texts(dataset_dir: Path, source: str):
    """(texts, provenance): train-split documents, in shard and row order, capped per document and
    in total. ClimbMix uses shards 0..TOKENIZER_CLIMBMIX_SHARDS-1 only, so every build agrees."""
    shards = split_shards("train", dataset_dir)
    if source == "climbmix":
        have = {int(SHARD_NAME.match(p.name).group(1)): p for p in shards}
        missing = [i for i in range(TOKENIZER_CLIMBMIX_SHARDS) if i not in have]
        if missing:
            raise TokenizerError(f"building the ClimbMix tokenizer needs train shards 0..{TOKENIZER_CLIMBMIX_SHARDS - 1}; "
                                 f"missing {missing}. Run setup with --num-train-shards {TOKENIZER_CLIMBMIX_SHARDS} or more.")
        shards = [have[i] for i in range(TOKENIZER_CLIMBMIX_SHARDS)]
    texts, chars = [], 0
    for path in shards:
        for doc in pq.read_table(path, columns=["text"]).column("text").to_pylist():
            doc = doc[:TOKENIZER_TRAIN_DOC_CAP]
            texts.append(doc)
            chars += len(doc)
            if chars >= TOKENIZER_TRAIN_MAX_CHARS:
                break
        if chars >= TOKENIZER_TRAIN_MAX_CHARS:
            break
    provenance = {"source": source, "shards": [p.name for p in shards], "documents": len(texts), "chars": chars,
                  "doc_cap": TOKENIZER_TRAIN_DOC_CAP, "max_chars": TOKENIZER_TRAIN_MAX_CHARS}
    return texts, provenance


def shipped_tokenizer_pins() -> dict[str, str]:
    """name -> SHA-256 of the artifacts shipped in tokenizer/, from tokenizer/SHA256SUMS."""
    if not SHIPPED_TOKENIZER_PINS.exists():
        return {}
    pins = {}
    for line in SHIPPED_TOKENIZER_PINS.read_text().splitlines():
        if line.strip():
            digest, filename = line.split()
            pins[filename.removesuffix(".json")] = digest
    return pins


def _tokenizer_location(dataset_dir: Path | None) -> tuple[str, Path, str | None, str, str]:
    """(name, path, pinned sha256 or None, where the pin lives, kind) of the tokenizer to use: the one
    named by $FRONTIER_TOKENIZER_PATH / $NEURON_COMPETITION_R1_TOKENIZER_PATH if set, else the
    dataset's (shipped in tokenizer/ or built into the dataset folder). kind: env, shipped or built."""
    override, variable = env_setting("tokenizer_path")
    if override:
        path = Path(override).expanduser()
        if path.suffix in (".pkl", ".pickle", ".zip"):
            raise TokenizerError(f"{variable}={override}: the kit reads only its plain JSON tokenizer format "
                                 f"({TOKENIZER_FORMAT}) and never loads pickles. Point it at a tokenizer .json "
                                 "(for example tokenizer/stdlib.json), or unset it to use the dataset's tokenizer.")
        pin, pin_variable = env_setting("tokenizer_sha256")
        if pin is None:
            raise TokenizerError(f"{variable}={override} has no pin: set FRONTIER_TOKENIZER_SHA256 (or "
                                 "NEURON_COMPETITION_R1_TOKENIZER_SHA256) to its SHA-256")
        return path.stem, path, pin.lower(), pin_variable, "env"
    dataset_dir = dataset_dir or active_dataset_dir()
    manifest = load_manifest(dataset_dir)
    name = manifest.get("tokenizer", {}).get("name") or dataset_name(manifest["source"])
    pins = shipped_tokenizer_pins()
    if name in pins:
        return name, SHIPPED_TOKENIZER_DIR / f"{name}.json", pins[name], str(SHIPPED_TOKENIZER_PINS), "shipped"
    return name, dataset_dir / "tokenizer.json", manifest.get("tokenizer", {}).get("sha256"), \
        str(dataset_dir / "manifest.json"), "built"


_TOKENIZER_CACHE: dict[tuple[str, str], Tokenizer] = {}


def ensure_tokenizer(build_if_missing: bool = False, dataset_dir: Path | None = None) -> Tokenizer:
    """The verified tokenizer: the one the environment names and pins (FRONTIER_TOKENIZER_PATH /
    NEURON_COMPETITION_R1_TOKENIZER_PATH with its _SHA256), else the active dataset's; or
    TokenizerError saying how to get one."""
    name, path, pinned, pin_file, kind = _tokenizer_location(dataset_dir)
    if kind != "env":
        dataset_dir = dataset_dir or active_dataset_dir()
        manifest = load_manifest(dataset_dir)
    if not path.exists():
        if kind == "env":
            raise TokenizerError(f"{path}: no such tokenizer file (named by the environment, pinned in {pin_file})")
        if kind == "shipped":
            raise TokenizerError(f"The shipped tokenizer {path} is missing (pinned in {pin_file}). "
                                 "Restore it: `git checkout -- tokenizer/`.")
        if not build_if_missing:
            raise TokenizerError(f"No tokenizer for dataset {dataset_dir} (expected {path}); none is shipped for "
                                 f"'{name}'. Build it: `python prepare.py setup --source {manifest['source']} "
                                 "--build-tokenizer-if-missing`.")
        log(f"[tokenizer] training BPE ({TOKENIZER_VOCAB_SIZE} tokens) from the train split of {dataset_dir}")
        t0 = time.time()
        texts, provenance = _tokenizer_training_texts(dataset_dir, manifest["source"])
        data = train_tokenizer(texts, name, provenance)
        atomic_write_bytes(path, data)
        pinned = hashlib.sha256(data).hexdigest()
        manifest["tokenizer"] = {"name": name, "sha256": pinned, "file": path.name}
        atomic_write_json(dataset_dir / "manifest.json", manifest)
        log(f"[tokenizer] trained in {time.time() - t0:.1f}s on {provenance['chars'] / 1e6:.1f}M characters; "
             f"sha256 {pinned}")
    actual = sha256_file(path)
    if pinned is None or actual != pinned:
        fix = ("restore it: `git checkout -- tokenizer/`" if kind == "shipped" else
               "check the file and the pin in the environment" if kind == "env" else
               f"delete it and rebuild: `rm {path} && python prepare.py setup --source {manifest['source']} "
               "--build-tokenizer-if-missing`")
        raise TokenizerError(f"Tokenizer {path} does not match its pin: sha256 {actual}, expected {pinned} "
                             f"(from {pin_file}). The file was modified or corrupted; {fix}.")
    key = (str(path), actual)
    if key not in _TOKENIZER_CACHE:
        _TOKENIZER_CACHE[key] = Tokenizer.from_file(path, actual)
    return _TOKENIZER_CACHE[key]


_TOKEN_BYTES_CACHE: dict[str, torch.Tensor] = {}


def get_token_bytes(device="cpu", tokenizer: Tokenizer | None = None) -> torch.Tensor:
    """int32 [vocab]: UTF-8 byte length of each token, 0 for special tokens."""
    tokenizer = tokenizer or ensure_tokenizer()
    if tokenizer.sha256 not in _TOKEN_BYTES_CACHE:
        _TOKEN_BYTES_CACHE[tokenizer.sha256] = torch.tensor(tokenizer.token_byte_lengths(), dtype=torch.int32)
    return _TOKEN_BYTES_CACHE[tokenizer.sha256].to(device)

