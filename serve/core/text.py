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
batch with every other request.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from model.config import EncoderConfig
from model.text import TokenizerError, read_tokenizer
from serve.errors import ValidationError
from serve.backend.export_dir import ExportDir, ExportError


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
        self._windows = read_tokenizer(tokenizer_file)
        self.overlap = max_length // 8
        self._windows.enable_truncation(max_length=max_length, stride=self.overlap)
        self.max_length = max_length
        vocab = self._full.get_vocab_size(with_added_tokens=True)
        if vocab > config.vocab_size:
            raise ExportError(
                f"{tokenizer_file}: tokenizer vocabulary ({vocab}) exceeds the model's vocab_size={config.vocab_size}"
            )
        probe = self._full.encode("probe")
        if any(probe.type_ids):
            raise ExportError(
                f"{tokenizer_file}: a single text gets token type ids {probe.type_ids}; this server feeds zeros"
            )

    @classmethod
    def from_export(cls, export: ExportDir) -> "TextTokenizer | None":
        """The export's tokenizer after checking its sha256, or None when the export has none."""
        path = export.tokenizer_file()
        if path is None:
            return None
        return cls(path, export.metadata.tokenizer.max_length, export.config)

    def encode(self, texts: Sequence[str], *, truncate: bool = False, chunk: bool = False
               ) -> tuple[tuple[np.ndarray, ...], tuple[bool, ...], tuple[int, ...]]:
        """(int64 [T] token ids per row (special tokens included), whether each text was truncated,
        rows per text: 1, or with `chunk` the windows of a text over max_length); ValidationError names
        `texts[i]`."""
        for i, text in enumerate(texts):
            if not text:
                raise ValidationError(f"texts[{i}]: empty text; send at least one character")
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
            for i, encoding in zip(over, self._cut.encode_batch([texts[i] for i in over])):
                encodings[i] = encoding
        cut = set(over)
        return (tuple(np.asarray(e.ids, dtype=np.int64) for e in encodings),
                tuple(i in cut for i in range(len(encodings))), (1,) * len(encodings))
