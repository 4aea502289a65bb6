"""Text as decoding commits it: `TextStream` (token ids in, completed characters out) and `stream_text`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from mtp_jax.decode.generation import stream
from mtp_jax.model import Transformer


class TextStream:
    """The text of a growing sequence of token ids, piece by piece, exact across split characters.

    Byte-level BPE can split one UTF-8 character (CJK, accents, symbols, emoji) over several
    tokens. `push` returns only completed characters and holds an incomplete one back (HF
    `tokenizers.decoders.DecodeStream`); `finish` returns what is still held back at the end (a
    character left incomplete decodes as U+FFFD, as in `Tokenizer.decode`). Everything returned,
    concatenated, equals `tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)` of all
    the ids pushed; `ids` and `text` hold both so far.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._decoder = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, ids: Sequence[int]) -> str:
        """Appends token ids; returns the characters they completed ("" when none)."""
        # One id per step: `DecodeStream.step` takes lists only in recent `tokenizers` releases.
        pieces = [self._decoder.step(self.tokenizer, int(i)) for i in ids]
        self.ids.extend(int(i) for i in ids)
        new = "".join(p for p in pieces if p)
        self.text += new
        return new

    def finish(self) -> str:
        """The end of the text that `push` held back (usually ""), once no more ids will come."""
        final = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if not final.startswith(self.text):  # DecodeStream emits only prefixes of the full decode
            raise RuntimeError(f"streamed text {self.text!r} is not a prefix of the decoded {final!r}")
        rest, self.text = final[len(self.text) :], final
        return rest


def stream_text(model: Transformer, tokenizer: Tokenizer, prompt: str, **kwargs) -> Iterator[str]:
    """The continuation of `prompt` as it is committed: after each decode step, the characters it completed.

    Characters split over several tokens are held back until complete (`TextStream`), so the
    concatenation of everything yielded is exactly `tokenizer.decode(tokens)` of the generated
    tokens (`generate(...).tokens[0]` with the same arguments). Steps that complete no character
    yield nothing. `kwargs` go to `mtp_jax.decode.generation.stream` (max_new_tokens, sampling,
    speculative, ...). Raises TypeError when `prompt` is not a str, and the errors of `stream`.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str (the text to continue), got {type(prompt).__name__}")
    text = TextStream(tokenizer)
    for step in stream(model, [tokenizer.encode(prompt).ids], **kwargs):
        if piece := text.push(step[0]):
            yield piece
    if rest := text.finish():
        yield rest
