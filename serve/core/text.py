"""Text -> token ids, for exports that ship a tokenizer (metadata.json "tokenizer").

`tokenizers` only: no torch, no transformers. Checked at start (`TextTokenizer.from_export`): the
file's sha256 equals metadata.json's, max_length fits the model, the vocabulary fits the
embedding table and a single text gets segment (token type) ids of 0, the zeros the batcher feeds.

Per request (`encode`): every text is non-empty; it is tokenized with the special tokens the file
defines ([CLS] … [SEP] for BERT) and no truncation, so a text over max_length is refused with its
length, or, when the request sets `truncate`, re-tokenized with truncation to max_length (as
sentence-transformers does), or, when it sets `chunk`, re-tokenized into overlapping windows of
max_length (tokenizers' own overflow with a stride of max_length / 8; each window has the special
tokens) that the Engine pools back into one embedding per text. Padding is the batcher's job: texts become ordinary token rows and
batch with every other request. An LLM reranker's rows (`encode_templated`) are its prompt template's parts (with
the query, the document, the instruction), each tokenized alone; only the document's tokens are ever cut.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import numpy as np

from model.config import EncoderConfig
from model.text import TokenizerError, read_tokenizer
from serve.errors import ValidationError
from serve.backend.export_dir import ExportDir, ExportError

DIRECTIONS = ("right", "left")  # which end of a text truncation cuts (TEI's truncation_direction)


class TextTokenizer:
    """Tokenizes request texts for one export; thread-safe (tokenizers' encode is re-entrant)."""

    def __init__(self, tokenizer_file, max_length: int, config: EncoderConfig) -> None:
        if not 1 <= max_length <= config.max_positions:
            raise ExportError(
                f"{tokenizer_file}: tokenizer max_length={max_length} is outside "
                f"1..max_positions={config.max_positions}"
            )
        try:
            self._full = read_tokenizer(tokenizer_file)  # no truncation: we measure, then refuse or cut
            self._cut = read_tokenizer(tokenizer_file)
        except TokenizerError as error:
            raise ExportError(str(error)) from None
        self._cut.enable_truncation(max_length=max_length)
        self._cut_left = read_tokenizer(tokenizer_file)
        self._cut_left.enable_truncation(max_length=max_length, direction="left")
        # sentence pairs (query, document): only the second is cut, from the side asked
        self._pair_cut = {}
        for direction in DIRECTIONS:
            self._pair_cut[direction] = read_tokenizer(tokenizer_file)
            self._pair_cut[direction].enable_truncation(max_length=max_length, strategy="only_second",
                                                        direction=direction)
        self._windows = read_tokenizer(tokenizer_file)
        self.overlap = max_length // 8
        self._windows.enable_truncation(max_length=max_length, stride=self.overlap)
        self.max_length = max_length
        self._file, self._config, self._limited = tokenizer_file, config, {max_length: self}
        self._parts: dict[str, list[int]] = {}  # an LLM reranker's template parts (encode_templated)
        vocab = self._full.get_vocab_size(with_added_tokens=True)
        if vocab > config.vocab_size:
            raise ExportError(
                f"{tokenizer_file}: tokenizer vocabulary ({vocab}) exceeds the model's vocab_size={config.vocab_size}"
            )
        probe = self._full.encode("probe")
        self.vocab_size = vocab
        if any(probe.type_ids):
            raise ExportError(
                f"{tokenizer_file}: a single text gets token type ids {probe.type_ids}; this server feeds zeros"
            )

    def limited(self, max_length: int) -> "TextTokenizer":
        """This tokenizer with another max_length (a ColBERT's query and document lengths), made once per
        length (two threads may both make one: either serves)."""
        found = self._limited.get(max_length)
        if found is None:
            found = self._limited[max_length] = TextTokenizer(self._file, max_length, self._config)
        return found

    @classmethod
    def from_export(cls, export: ExportDir) -> "TextTokenizer | None":
        """The export's tokenizer after checking its sha256, or None when the export has none."""
        path = export.tokenizer_file()
        if path is None:
            return None
        return cls(path, export.metadata.tokenizer.max_length, export.config)

    def encode(self, texts: Sequence[str], *, truncate: bool = False, chunk: bool = False,
               direction: str = "right", prompt: str = ""
               ) -> tuple[tuple[np.ndarray, ...], tuple[bool, ...], tuple[int, ...]]:
        """(int64 [T] token ids per row (special tokens included), whether each text was truncated,
        rows per text: 1, or with `chunk` the windows of a text over max_length); ValidationError names
        `texts[i]`. `direction`: the end a truncated text loses; `prompt`: put before every text (its
        tokens count toward max_length, as sentence-transformers counts them)."""
        for i, text in enumerate(texts):
            if not text:
                raise ValidationError(f"texts[{i}]: empty text; send at least one character")
        if prompt:
            texts = [prompt + text for text in texts]
        encodings = self._full.encode_batch(list(texts))
        over = [i for i, e in enumerate(encodings) if len(e.ids) > self.max_length]
        if over and chunk:
            windows = dict(zip(over, self._windows.encode_batch([texts[i] for i in over])))
            rows = [[e] if i not in windows else [windows[i], *windows[i].overflowing]
                    for i, e in enumerate(encodings)]
            return (tuple(np.asarray(w.ids, dtype=np.int64) for text in rows for w in text),
                    (False,) * len(encodings), tuple(len(text) for text in rows))
        if over and not truncate:
            i = over[0]
            raise ValidationError(
                f"texts[{i}]: {len(encodings[i].ids)} tokens exceed max_text_tokens={self.max_length} "
                f"(special tokens included); shorten it or set truncate=true"
            )
        if over:
            cut = self._cut if direction == "right" else self._cut_left
            for i, encoding in zip(over, cut.encode_batch([texts[i] for i in over])):
                encodings[i] = encoding
        cut = set(over)
        return (tuple(np.asarray(e.ids, dtype=np.int64) for e in encodings),
                tuple(i in cut for i in range(len(encodings))), (1,) * len(encodings))

    def encode_pairs(self, pairs: Sequence[tuple[str, str]], *, truncate: bool = False, direction: str = "right",
                     fields: tuple[str, str] = ("pairs[{i}][0]", "pairs[{i}][1]"),
                     ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...], tuple[bool, ...]]:
        """Sentence pairs as one row each, with the pair's special tokens ([CLS] a [SEP] b [SEP];
        <s> a </s></s> b </s>): (int64 ids per row, int64 token type ids per row, whether each was cut).
        A pair over max_length is refused naming its second text, or with `truncate` has only its
        second text cut (from `direction`), as a cross-encoder's documents are; a first text that
        leaves no room is refused naming it. `fields`: the two texts' names, with {i} the pair's index."""
        first, second = fields
        for i, (a, b) in enumerate(pairs):
            for text, field in ((a, first), (b, second)):
                if not text:
                    raise ValidationError(f"{field.format(i=i)}: empty text; send at least one character")
        encodings = self._full.encode_batch([(a, b) for a, b in pairs])
        over = [i for i, e in enumerate(encodings) if len(e.ids) > self.max_length]
        room = self.max_length - self._full.num_special_tokens_to_add(True)  # for the two texts' own tokens
        for i in over:  # a first text that leaves the second no token is refused by its own name
            if len(self._full.encode(pairs[i][0], add_special_tokens=False).ids) >= room:
                raise ValidationError(
                    f"{first.format(i=i)}: too long to pair with any text within max_text_tokens="
                    f"{self.max_length} (special tokens included; only the second text is ever cut); shorten it")
        if over and not truncate:
            i = over[0]
            raise ValidationError(
                f"{second.format(i=i)}: with {first.format(i=i)} it makes {len(encodings[i].ids)} tokens, over "
                f"max_text_tokens={self.max_length} (special tokens included); shorten it or set truncate=true "
                f"(the second text is cut)")
        for i in over:
            try:
                encodings[i] = self._pair_cut[direction].encode(*pairs[i])
            except Exception:  # tokenizers: the second text cannot lose enough tokens
                raise ValidationError(
                    f"{first.format(i=i)}: too long to pair with any text within max_text_tokens="
                    f"{self.max_length} (only the second text is cut); shorten it") from None
        cut = set(over)
        return (tuple(np.asarray(e.ids, dtype=np.int64) for e in encodings),
                tuple(np.asarray(e.type_ids, dtype=np.int64) for e in encodings),
                tuple(i in cut for i in range(len(encodings))))

    def encode_templated(self, template: Mapping[str, Any], query: str, documents: Sequence[str], *,
                         instruction: str | None = None, truncate: bool = False, direction: str = "right",
                         fields: tuple[str, str] = ("query", "documents[{i}]"),
                         ) -> tuple[tuple[np.ndarray, ...], tuple[bool, ...]]:
        """An LLM reranker's rows (metadata.json task "template", model/tasks.py): the tokens of each of the
        template's parts with the query, the document and the instruction (None: the template's) in place, each
        part tokenized alone without special tokens, as the model card's recipe does: (int64 ids per row,
        whether each was cut). A row over max_length is refused naming its document, or with `truncate` has
        only its document's tokens cut (from `direction`); a query that leaves a document no token is refused
        naming it. `fields`: the query's and the documents' names ({i}: the document)."""
        first, second = fields
        values = {"instruction": template["instruction"] if instruction is None else instruction, "query": query}
        parts = [re.sub(r"\{(instruction|query)\}", lambda m: values[m.group(1)], part) if "{" in part else part
                 for part in template["parts"]]
        at = next(i for i, part in enumerate(template["parts"]) if "{document}" in part)
        before, after = parts[at].split("{document}")
        tokens = [self._part_tokens(part, fixed="{" not in raw) for part, raw in zip(parts, template["parts"])]
        head, tail = [t for ids in tokens[:at] for t in ids], [t for ids in tokens[at + 1:] for t in ids]
        budget = self.max_length - len(head) - len(tail)  # the document part's tokens
        encodings = self._full.encode_batch([before + d + after for d in documents], add_special_tokens=False)
        rows, cut = [], []
        for i, (document, encoding) in enumerate(zip(documents, encodings)):
            ids = encoding.ids
            if len(ids) <= budget:
                rows.append(np.asarray(head + ids + tail, dtype=np.int64))
                cut.append(False)
                continue
            # the document's tokens: those covering any of its characters (" word" across its start is its own)
            end = len(before) + len(document)
            lead = sum(1 for _, stop in encoding.offsets if stop <= len(before))
            trail = sum(1 for start, _ in encoding.offsets if start >= end) if after else 0
            keep = budget - lead - trail
            if keep < 1:
                raise ValidationError(
                    f"{first}: too long to pair with any document within max_text_tokens={self.max_length} (the "
                    f"template and the instruction included; only the document is ever cut); shorten it")
            if not truncate:
                raise ValidationError(
                    f"{second.format(i=i)}: in the template with {first} it makes {len(head) + len(ids) + len(tail)} "
                    f"tokens, over max_text_tokens={self.max_length}; shorten it or set truncate=true (the document is "
                    f"cut)")
            body = ids[lead:len(ids) - trail]
            body = body[:keep] if direction == "right" else body[len(body) - keep:]
            rows.append(np.asarray(head + ids[:lead] + body + ids[len(ids) - trail:] + tail, dtype=np.int64))
            cut.append(True)
        return tuple(rows), tuple(cut)

    def _part_tokens(self, part: str, fixed: bool) -> list[int]:
        """One template part's tokens (without special tokens); a `fixed` part (no placeholder) tokenized once."""
        if fixed and part in self._parts:
            return self._parts[part]
        ids = self._full.encode(part, add_special_tokens=False).ids if part else []
        if fixed:
            self._parts[part] = ids
        return ids

    def keep(self, texts: Sequence[str], tokens: int, *, cut: bool, direction: str = "right",
             field: str = "texts", limit: str = "max_tokens") -> tuple[tuple[str, ...], tuple[bool, ...]]:
        """Each text at most `tokens` tokens long (special tokens not counted): a longer one cut at a token's edge
        (losing its `direction` end) when `cut`, else refused naming `field`[i] and `limit` (Cohere's embed
        max_tokens, its rerank max_tokens_per_doc). Returns the texts and which were cut."""
        kept, was_cut = [], []
        for i, (text, encoding) in enumerate(zip(texts, self._full.encode_batch(list(texts),
                                                                                  add_special_tokens=False))):
            count = len(encoding.ids)
            if count <= tokens:
                kept.append(text)
                was_cut.append(False)
                continue
            if not cut:
                raise ValidationError(f"{field}[{i}]: {count} tokens exceed {limit}={tokens} (special tokens not "
                                      f"counted); shorten it or let it be cut")
            kept.append(text[: encoding.offsets[tokens - 1][1]] if direction == "right"
                        else text[encoding.offsets[count - tokens][0]:])
            was_cut.append(True)
        return tuple(kept), tuple(was_cut)

    def tokens(self, texts: Sequence[str], *, add_special_tokens: bool = True, prompt: str = "") -> list[list[dict]]:
        """Each text's tokens as text-embeddings-inference's /tokenize shows them: id, text (a special
        token's own text, else the characters it covers), special, and the character offsets start/stop
        (None for a special token)."""
        texts = [prompt + text for text in texts]
        out = []
        for text, e in zip(texts, self._full.encode_batch(texts, add_special_tokens=add_special_tokens)):
            tokens = []
            for token_id, token, (start, stop), special in zip(e.ids, e.tokens, e.offsets, e.special_tokens_mask):
                tokens.append({"id": int(token_id), "text": token, "special": True, "start": None, "stop": None}
                              if special else
                              {"id": int(token_id), "text": text[start:stop], "special": False, "start": start,
                               "stop": stop})
            out.append(tokens)
        return out

    def decode(self, ids: Sequence[Sequence[int]], *, skip_special_tokens: bool = True, field: str = "ids") -> list[str]:
        """Token ids back to text, one string per list; an id outside the vocabulary is refused naming it."""
        size = self._full.get_vocab_size(with_added_tokens=True)
        for i, row in enumerate(ids):
            bad = [t for t in row if not 0 <= t < size]
            if bad:
                raise ValidationError(f"{field}[{i}]: token id {bad[0]} is outside the vocabulary [0, {size})")
        return self._full.decode_batch([list(row) for row in ids], skip_special_tokens=skip_special_tokens)
