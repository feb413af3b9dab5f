"""Text in and out of the runtime: tokenizer, incremental detokenizer, stop-string holdback.

- :class:`Codec` wraps ``tokenizers.Tokenizer.from_file(root / "tokenizer.json")`` with the
  checkpoint's EOS ids (``generation_config.json``, ``config.json``, ``tokenizer_config.json``) and
  per-token strings and bytes for ``logprobs``.
- :class:`IncrementalDetokenizer` turns a token stream into text deltas that never split a
  character: byte-level BPE tokens may carry half of a multi-byte UTF-8 character, so a delta is
  released only once its decoded text no longer ends in U+FFFD. The prefix/read offsets follow
  Hugging Face text-generation-inference (``server/text_generation_server/models/model.py``,
  ``decode_token``): decoding a short window that starts a few tokens back keeps tokenizers that
  strip a leading space (Metaspace) from eating word breaks.
- :class:`StopStrings` releases text only when no stop string can still start inside it: the
  longest suffix that is a prefix of a stop string is held back until the next delta decides.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from shardsmith.errors import RuntimeLoadError
from shardsmith.runtime.serve.chat import token_content

REPLACEMENT = "\ufffd"


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted (``openai/gpt-2`` ``encoder.py``, ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _ids(value) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class Codec:
    """The checkpoint's tokenizer plus what serving needs around it.

    Attributes:
        eos_token_ids: token ids that end generation (sorted, deduplicated).
        special_ids: ids of special added tokens (skipped in output text).
        vocab_size: tokens in the tokenizer (with added tokens).
    """

    def __init__(self, root: Path) -> None:
        from tokenizers import Tokenizer

        root = Path(root)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise RuntimeLoadError(f"{root}: no tokenizer.json (the server needs the tokenizer next to the weights)")
        self._tok = Tokenizer.from_file(str(path))
        spec = json.loads(self._tok.to_str())
        self._byte_level = _has_type(spec.get("decoder"), "ByteLevel")
        self.special_ids = frozenset(t["id"] for t in spec.get("added_tokens", []) if t.get("special"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            if (root / name).is_file():
                eos.update(_ids(json.loads((root / name).read_text(encoding="utf-8")).get("eos_token_id")))
        if (root / "tokenizer_config.json").is_file():
            cfg = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
            if (text := token_content(cfg.get("eos_token"))) is not None and (i := self._tok.token_to_id(text)) is not None:
                eos.add(i)
        self.eos_token_ids = tuple(sorted(eos))
        self._added: tuple[list[int], list[int]] | None = None

    def tokenizer_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (for a grammar engine's own tokenizer)."""
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in it are matched, none are added.

        For text that already carries its special tokens: a rendered chat template (it writes
        its own BOS). ``encode_batch`` rather than ``encode``: it releases the GIL while it works,
        so a long prompt tokenized on a worker thread does not stall the server's event loop.
        """
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a plain prompt, with the special tokens the tokenizer's configuration adds.

        As transformers' ``tokenizer(text)`` does: the ``post_processor`` of ``tokenizer.json``
        adds them (DeepSeek's ``TemplateProcessing`` puts BOS first; converters write
        ``tokenizer_config.json``'s ``add_bos_token`` into it; SmolLM2 adds none). Unlike
        transformers, a BOS is never doubled: when the text itself starts with the tokens the
        post-processor would put in front, they are not added again. One tokenization, as
        :meth:`encode`; the added tokens were found once (:attr:`added_tokens`).
        """
        ids = self.encode(text)
        front, back = self.added_tokens
        if front and ids[:len(front)] == front:
            front = []
        return front + ids + back

    @property
    def added_tokens(self) -> tuple[list[int], list[int]]:
        """``(before, after)``: the ids the post-processor puts around a single sequence (fixed for
        every post-processor ``tokenizers`` ships: template, BERT, RoBERTa, byte-level)."""
        if self._added is None:
            for text in ("a", "0", ".", " "):  # a text this vocabulary encodes to something
                if probe := self._tok.encode(text, add_special_tokens=False).ids:
                    wrapped = self._tok.encode(text, add_special_tokens=True).ids
                    start = _front(wrapped, probe)
                    self._added = (wrapped[:start], wrapped[start + len(probe):])
                    break
            else:  # nothing to tell before from after: what an empty text gets goes in front
                self._added = (self._tok.encode("", add_special_tokens=True).ids, [])
        return self._added

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (byte-level BPE: undo GPT-2's byte-to-unicode map)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and token_id not in self.special_ids:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_str(self, token_id: int) -> str:
        """One token as text for ``logprobs`` (a partial character shows as U+FFFD, as OpenAI does)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _front(full: list[int], plain: list[int]) -> int:
    """How many tokens a post-processor put before ``plain`` in ``full`` (0 when ``plain`` is not
    inside ``full``)."""
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return start
    return 0


def _has_type(node, name: str) -> bool:
    if not isinstance(node, dict):
        return False
    return node.get("type") == name or any(_has_type(d, name) for d in node.get("decoders") or [])


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence, never cutting a UTF-8 character.

    Args:
        codec: the tokenizer.
        prompt_ids: the prompt; its last ``context`` tokens seed the window so that the first
            generated token decodes with its leading space.
    """

    def __init__(self, codec: Codec, prompt_ids: list[int], *, context: int = 5,
                 skip_special_tokens: bool = True) -> None:
        self._codec = codec
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-context:]) if context else []
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while a character is partial)."""
        self._ids.append(token_id)
        before = self._codec.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = self._codec.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Text of tokens still held (an incomplete character at the very end shows as U+FFFD)."""
        if self._read >= len(self._ids):
            return ""
        before = self._codec.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = self._codec.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        self._prefix = self._read = len(self._ids)
        return after[len(before):]


class StopStrings:
    """Cut generated text at the first stop string; hold back what could begin one.

    Example:
        >>> s = StopStrings(["###"])
        >>> s.push("Paris.#"), s.push("#"), s.push("# more")
        (('Paris.', False), ('', False), ('', True))
    """

    def __init__(self, stops: list[str] | tuple[str, ...], *, include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include  # the stop string itself is emitted (vLLM's include_stop_str_in_output)
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Return ``(text safe to emit, stopped)``; once stopped, the rest of the stream is dropped."""
        buf = self._pending + text
        hits = [(i, -len(s)) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self._pending = ""
            at, neg_len = min(hits)  # the first stop string; of two starting there, the longer
            return buf[:at - neg_len if self.include else at], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, at the end of generation (it did not become a stop string)."""
        out, self._pending = self._pending, ""
        return out
