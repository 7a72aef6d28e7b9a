"""Tokenizers: built-in bytes, Hugging Face tokenizer.json, SentencePiece and tiktoken-format tokenizer.model."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from titan_npu.errors import DataError

# Meta's Llama 3 pre-tokenisation pattern (tiktoken format tokenizer.model).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL_TOKENS = 256
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]

# Names tried when a tokenizer.json comes without tokenizer_config.json / special_tokens_map.json.
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")
_PAD_CANDIDATES = ("<|finetune_right_pad_id|>", "<pad>", "<|pad|>", "[PAD]")

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} \d+\r?$")


def _require(module: str, pip_name: str, what: str):
    """Import an optional dependency, or raise a DataError with the install command."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what} needs the '{pip_name}' package, which is not installed; pip install {pip_name}") \
            from None


def _short_hash(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


class Tokenizer:
    """Text <-> token ids. Subclasses implement _encode_batch, decode and _identity (what the fingerprint hashes)."""

    name: str = "tokenizer"
    vocab_size: int
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of text, with BOS in front and EOS at the end when asked (and the tokenizer has them)."""
        return self._wrap(self._encode_batch([text])[0], bos, eos)

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        """encode() for many texts at once (faster for library-backed tokenizers)."""
        return [self._wrap(ids, bos, eos) for ids in self._encode_batch(list(texts))]

    def encode_flat(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """encode_batch() as one int64 array of all ids plus the per-text lengths (what prepare-data writes)."""
        ids = self.encode_batch(texts, bos, eos)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum())), lengths

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def special_tokens(self) -> dict[str, str]:
        """bos_token / eos_token / pad_token strings: what a chat template sees (transformers' special_tokens_map)."""
        return {}

    def token_id(self, token: str) -> int | None:
        """The id of one whole token written as text (a special token such as <|im_end|>), else None."""
        return None

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of a rendered chat, its special-token strings read as those tokens, and each id's (start, end)
        characters in text (what the assistant mask is mapped through)."""
        raise DataError(f"tokenizer {self.name} cannot encode chat templates (its special tokens have no text form "
                        "here); use a tokenizer.json, a tiktoken tokenizer.model or 'byte'")

    def fingerprint(self) -> str:
        """A stable hash of what decides the ids (vocab, merges, pattern, special tokens); computed once."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            special = json.dumps([self.vocab_size, self.bos_id, self.eos_id]).encode()
            cached = self.__dict__["_fingerprint"] = _short_hash(self._identity(), special)
        return cached

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def _identity(self) -> bytes:
        raise NotImplementedError

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if eos and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return ids

    def __repr__(self) -> str:
        specials = f"bos={self.bos_id}, eos={self.eos_id}"
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size}, {specials})"


# The byte tokenizer's BOS and EOS written as text: how chat templates name them (decoding drops them).
BYTE_SPECIAL_TOKENS = ("<s>", "</s>")
_BYTE_SPECIAL_IDS = {BYTE_SPECIAL_TOKENS[0]: 256, BYTE_SPECIAL_TOKENS[1]: 257}
_BYTE_SPECIAL_SPLIT = re.compile("(" + "|".join(map(re.escape, BYTE_SPECIAL_TOKENS)) + ")")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, BOS = 256, EOS = 257; needs no file."""

    name = "byte"
    vocab_size = 258
    bos_id = 256
    eos_id = 257
    pad_id = None

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_flat(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
        encoded = [t.encode("utf-8") for t in texts]
        body_lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        body = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        lengths = body_lengths + int(bos) + int(eos)
        out = np.empty(int(lengths.sum()), dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        is_body = np.ones(len(out), dtype=bool)
        if bos:
            out[starts], is_body[starts] = self.bos_id, False
        if eos:
            out[starts + lengths - 1], is_body[starts + lengths - 1] = self.eos_id, False
        out[is_body] = body
        return out, lengths

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def special_tokens(self) -> dict[str, str]:
        return {"bos_token": BYTE_SPECIAL_TOKENS[0], "eos_token": BYTE_SPECIAL_TOKENS[1]}

    def token_id(self, token: str) -> int | None:
        return _BYTE_SPECIAL_IDS.get(token)

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        pos = 0
        for piece in _BYTE_SPECIAL_SPLIT.split(text):
            if piece in _BYTE_SPECIAL_IDS:
                ids.append(_BYTE_SPECIAL_IDS[piece])
                offsets.append((pos, pos + len(piece)))
            else:
                for i, ch in enumerate(piece):  # every byte of a character spans that character, as byte-level BPE
                    encoded = ch.encode("utf-8", errors="surrogatepass")
                    ids.extend(encoded)
                    offsets.extend([(pos + i, pos + i + 1)] * len(encoded))
            pos += len(piece)
        return ids, offsets

    def _identity(self) -> bytes:
        return b"titan-npu byte tokenizer v1"


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json (tokenizers library); BOS/EOS/PAD from tokenizer_config.json beside it."""

    def __init__(self, path: Path):
        tokenizers = _require("tokenizers", "tokenizers", f"tokenizer {path}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own exception type for malformed files
            raise DataError(
                f"tokenizer {path} is not a valid tokenizer.json ({e}); point data.tokenizer at another"
            ) from None
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        special = self._special = _special_tokens_beside(path.parent)
        self.bos_id = self._token_id(special.get("bos_token"), _BOS_CANDIDATES)
        self.eos_id = self._token_id(special.get("eos_token"), _EOS_CANDIDATES)
        self.pad_id = self._token_id(special.get("pad_token"), _PAD_CANDIDATES)
        # Padding/truncation settings do not change the ids of one text; everything else does.
        self._tok.no_padding()
        self._tok.no_truncation()

    def _token_id(self, configured: str | None, candidates: tuple[str, ...]) -> int | None:
        for token in ([configured] if configured else []) + list(candidates):
            tid = self._tok.token_to_id(token)
            if tid is not None:
                return tid
            if token == configured:
                raise DataError(
                    f"tokenizer {self.name}: special token {token!r} from tokenizer_config.json is not in its vocab; "
                    "fix tokenizer_config.json"
                )
        return None

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def special_tokens(self) -> dict[str, str]:
        found = dict(self._special)
        for key, tid in (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id)):
            if key not in found and tid is not None:
                found[key] = self._tok.id_to_token(tid)
        return found

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        # What transformers' tokenizer(rendered_chat, add_special_tokens=False) does: added tokens are matched.
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def _identity(self) -> bytes:
        # The library's own serialisation: independent of how the file was formatted.
        return self._tok.to_str().encode()


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece tokenizer.model (Llama 2); BOS/EOS/PAD are the model's own."""

    def __init__(self, path: Path):
        spm = _require("sentencepiece", "sentencepiece", f"tokenizer {path}")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except Exception as e:  # sentencepiece raises OSError/RuntimeError depending on version
            raise DataError(f"tokenizer {path} is not a valid SentencePiece model ({e}); check the file") from None
        self.name = str(path)
        self.vocab_size = int(self._sp.GetPieceSize())
        self.bos_id = _none_if_negative(self._sp.bos_id())
        self.eos_id = _none_if_negative(self._sp.eos_id())
        self.pad_id = _none_if_negative(self._sp.pad_id())

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.Encode(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.Decode(list(ids))

    def _identity(self) -> bytes:
        return self._sp.serialized_model_proto()


class TiktokenTokenizer(Tokenizer):
    """A tiktoken-format tokenizer.model (Llama 3: base64 token + rank per line) with the Llama 3 pattern."""

    def __init__(self, path: Path):
        tiktoken = _require("tiktoken", "tiktoken", f"tokenizer {path}")
        ranks: dict[bytes, int] = {}
        for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise DataError(
                    f"{path}:{lineno}: not a tiktoken line ('<base64 token> <rank>'); check the tokenizer file"
                ) from None
        n_base = len(ranks)
        reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(LLAMA3_NUM_SPECIAL_TOKENS - 11)]
        special = self._special_ids = {tok: n_base + i for i, tok in enumerate(LLAMA3_SPECIAL_TOKENS + reserved)}
        self._enc = tiktoken.Encoding(name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=special)
        self.name = str(path)
        self.vocab_size = n_base + len(special)
        configured = _special_tokens_beside(path.parent)
        defaults = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                    "pad_token": "<|finetune_right_pad_id|>"}
        ids = {}
        for key, default in defaults.items():
            token = configured.get(key, default)
            if token not in special:
                raise DataError(f"tokenizer {path}: {key} {token!r} from tokenizer_config.json is not a Llama 3 "
                                "special token; fix tokenizer_config.json")
            ids[key] = special[token]
        self.bos_id, self.eos_id, self.pad_id = ids["bos_token"], ids["eos_token"], ids["pad_token"]
        self._ranks_bytes = b"\n".join(base64.b64encode(t) + b" %d" % r for t, r in sorted(ranks.items(), key=_by_rank))

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Special-token strings inside training text are plain text, never control tokens.
        return [self._enc.encode(t, disallowed_special=()) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(list(ids))

    def special_tokens(self) -> dict[str, str]:
        by_id = {tid: tok for tok, tid in self._special_ids.items()}
        return {key: by_id[tid] for key, tid in (("bos_token", self.bos_id), ("eos_token", self.eos_id),
                                                 ("pad_token", self.pad_id)) if tid in by_id}

    def token_id(self, token: str) -> int | None:
        return self._special_ids.get(token)

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids = self._enc.encode(text, allowed_special="all")
        _, starts = self._enc.decode_with_offsets(ids)
        ends = [*starts[1:], len(text)]
        return ids, [(s, max(s, e)) for s, e in zip(starts, ends)]

    def _identity(self) -> bytes:
        return self._ranks_bytes + LLAMA3_PATTERN.encode()


def _by_rank(item: tuple[bytes, int]) -> int:
    return item[1]


def _none_if_negative(i: int) -> int | None:
    return None if i < 0 else int(i)


def _special_tokens_beside(folder: Path) -> dict[str, str]:
    """bos_token / eos_token / pad_token strings from tokenizer_config.json or special_tokens_map.json in folder."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        f = folder / name
        if not f.is_file():
            continue
        try:
            cfg = json.loads(f.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{f} is not valid JSON ({e}); fix or remove it") from None
        except OSError as e:
            from titan_npu.data.files import os_error

            raise os_error(f, e) from None
        for key in ("bos_token", "eos_token", "pad_token"):
            value = cfg.get(key)
            if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
                value = value.get("content")
            if isinstance(value, str) and value:
                found[key] = value
    return found


def _is_tiktoken_file(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).split(b"\n")
    lines = [line for line in head[:-1] if line.strip()] or [line for line in head if line.strip()]
    return bool(lines) and all(_TIKTOKEN_LINE.match(line) for line in lines[:8])


def _find_in_dir(folder: Path) -> Path:
    for candidate in ("tokenizer.json", "tokenizer.model", "original/tokenizer.model"):
        if (folder / candidate).is_file():
            return folder / candidate
    raise DataError(
        f"tokenizer directory {folder} holds no tokenizer.json or tokenizer.model; point data.tokenizer at the file"
    )


# data.tokenizer values that name the built-in byte tokenizer (no file).
BYTE_TOKENIZER_NAMES = ("byte", "bytes")


def build_tokenizer(spec: str) -> Tokenizer:
    """'byte', a tokenizer.json, a tokenizer.model (SentencePiece or tiktoken format) or a directory holding one."""
    if spec in BYTE_TOKENIZER_NAMES:
        return ByteTokenizer()
    from titan_npu.data.files import open_input, os_error

    path = Path(spec).expanduser()
    if path.is_dir():
        path = _find_in_dir(path)
    if not path.exists():
        raise DataError(
            f"tokenizer '{spec}' not found: use 'byte', a tokenizer.json / tokenizer.model file or a directory "
            "holding one"
        )
    with open_input(path, "point data.tokenizer (--tokenizer) at a regular tokenizer.json / tokenizer.model") as f:
        try:
            first = f.read(64).lstrip()
        except OSError as e:
            raise os_error(path, e) from None
    if path.suffix == ".json" or first.startswith(b"{"):
        return HFTokenizer(path)
    if _is_tiktoken_file(path):
        return TiktokenTokenizer(path)
    return SentencePieceTokenizer(path)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """DataError when the tokenizer can produce ids that the model's embedding has no row for."""
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids but model.vocab_size is {model_vocab_size}; "
            f"set model.vocab_size >= {tokenizer.vocab_size} or use a smaller tokenizer"
        )
