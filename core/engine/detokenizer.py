"""A sequence's output text, decoded incrementally: the one detokenizer behind stop strings, streamed deltas and the
final text, so that what a stream sent always adds up to what a non-streamed request returns.

``tokenizers``' ``DecodeStream`` adds each token's text as it comes (about 2 us a token; decoding a window of the
last tokens twice per token, as this engine did before, took about 90 us), holding back the bytes of a character a
later token completes. It is fed lazily: the text catches up on the tokens it has not seen when somebody reads it
(a stop-string check after each token, a server's stream after each step, the output at the end), so a request
without stop strings decodes its output once.
"""

from __future__ import annotations

from bisect import bisect_right

from tokenizers.decoders import DecodeStream


class Detokenizer:
    """The text of one sequence's output tokens, grown token by token; remembers where each token's text ends."""

    def __init__(self, tokenizer):
        """``tokenizer``: a transformers fast tokenizer (its ``backend_tokenizer`` decodes) or a ``tokenizers``
        ``Tokenizer``."""
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True)
        self.text = ""
        # text_ends[i]: characters of text once output token i was fed (a held-back partial character excluded).
        self.text_ends: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.text_ends)

    def update(self, token_ids: list[int]) -> str:
        """Feed the tokens of ``token_ids`` (a sequence's whole output so far) past those already fed; the text."""
        for token in token_ids[len(self.text_ends) :]:
            chunk = self._stream.step(self._backend, token)
            if chunk:
                self.text += chunk
            self.text_ends.append(len(self.text))
        return self.text

    def text_start_of_token(self, index: int) -> int:
        """Where the text of output token ``index`` (0-based, already fed) begins: the characters before it."""
        return self.text_ends[index - 1] if index > 0 else 0

    def token_of_char(self, position: int) -> int:
        """The output token whose text holds character ``position``."""
        return bisect_right(self.text_ends, position)
