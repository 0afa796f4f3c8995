"""Incremental detokenization with stop strings: whole UTF-8 characters only, partial stops held back.

Owns the text of one request; runs on the event-loop side. No onnxruntime import.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# NOTE(engine): DecodeStream is primed with the prompt's last few tokens so the first generated token
# decodes with the spacing it has in context (SentencePiece-style decoders strip a leading space).
_PRIME_TOKENS = 4


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, holding back what could still become a stop string.

    Usage::

        detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=("\\n\\n",))
        stop = detok.update([token_id], stop_terminated=False)   # per step
        delta = detok.next_delta(finished=stop is not None)       # text safe to send now

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        prompt_ids: the prompt (its tail primes the decoder).
        stop: stop strings; the first one that appears ends the request and is cut from the text.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens (eos, ChatML markers) from the text.
        preserved_token_ids: special tokens kept in the text although ``skip_special_tokens`` (tool-call
            markup a parser needs, e.g. Mistral's ``[TOOL_CALLS]``); the other special tokens are still dropped.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], *, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 preserved_token_ids: Collection[int] = ()) -> None:
        self._tokenizer = tokenizer
        # NOTE(tools): DecodeStream skips all special tokens or none. To keep a few, it decodes them all and
        # this class never feeds it the special tokens that are not preserved (a byte-level special token is a
        # whole string, so leaving one out never changes how its neighbours decode).
        self._skip_ids: frozenset[int] = frozenset()
        if skip_special_tokens and preserved_token_ids:
            special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
            self._skip_ids = frozenset(special - set(preserved_token_ids))
            skip_special_tokens = False
        self._skip_special_tokens = skip_special_tokens
        prime = [t for t in prompt_ids[-_PRIME_TOKENS:] if t not in self._skip_ids]
        self._stream = self._new_stream(prime)
        self._pending: list[int] = []  # ids stepped since the stream last returned text
        self._recent: list[int] = prime
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        # NOTE(engine): len(longest stop) - 1 characters could be the start of a stop string; they stay
        # back until the next token decides. Keeping the stop in the output needs no hold-back.
        self._max_stop_len = max(map(len, self.stop)) if self.stop else 0
        self._hold_back = self._max_stop_len - 1 if self.stop and not include_stop_str_in_output else 0
        self.text = ""
        self._sent = 0  # characters of self.text already returned by next_delta
        self.matched_stop: str | None = None

    def update(self, token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Decode new tokens and look for stop strings in the new text.

        Args:
            token_ids: tokens generated since the last call.
            stop_terminated: the last token ended the request (eos or a stop token id); it is not
                decoded unless include_stop_str_in_output.
        Returns:
            The stop string found (the text is already cut), or None.
        """
        if self.matched_stop is not None:
            return self.matched_stop
        ids = token_ids[:-1] if stop_terminated and not self.include_stop_str_in_output else token_ids
        start = len(self.text)
        for token_id in ids:
            if token_id in self._skip_ids:
                continue
            try:
                chunk = self._stream.step(self._tokenizer, token_id)
            except Exception:  # noqa: BLE001 (tokenizers raises a plain Exception)
                chunk = self._restart(token_id)
            self._pending.append(token_id)
            if chunk:
                self.text += chunk
                self._pending.clear()
            self._recent = (self._recent + [token_id])[-_PRIME_TOKENS:]
        if self.stop and len(self.text) > start:
            return self._check_stop(start)
        return None

    def _new_stream(self, prime: list[int]) -> DecodeStream:
        if prime:
            return DecodeStream(ids=prime, skip_special_tokens=self._skip_special_tokens)
        return DecodeStream(skip_special_tokens=self._skip_special_tokens)

    def _restart(self, token_id: int) -> str:
        """DecodeStream gives up ("Invalid prefix") once byte-fallback pieces (<0xNN>) form invalid UTF-8,
        e.g. bytes of a character that never completes. Decode what it held plus this token as they are
        (U+FFFD for the broken bytes) and start a new stream primed with the recent whole pieces."""
        text = self._tokenizer.decode(self._pending + [token_id], skip_special_tokens=self._skip_special_tokens)
        prime = [t for t in self._recent + [token_id] if not (self._tokenizer.id_to_token(t) or "").startswith("<0x")]
        self._stream = self._new_stream(prime[-_PRIME_TOKENS:])
        return text

    def next_delta(self, finished: bool = False) -> str:
        """The text not yet returned that can be sent now (everything once ``finished``)."""
        end = len(self.text) if finished or self.matched_stop is not None else len(self.text) - self._hold_back
        if end <= self._sent:
            return ""
        delta = self.text[self._sent:end]
        self._sent = end
        return delta

    def _check_stop(self, new_start: int) -> str | None:
        # A stop string may begin in text that was held back before this update.
        search_from = max(0, new_start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[:at + len(stop)] if self.include_stop_str_in_output else self.text[:at]
        self.matched_stop = stop
        return stop
