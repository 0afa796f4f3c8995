"""An independent port of llama.cpp's SentencePiece tokenizer (llama-vocab.cpp: tokenizer_st_partition and
llm_tokenizer_spm), to check the tokenizers.Tokenizer that engine.builder rebuilds from a GGUF."""

from __future__ import annotations

import heapq

from engine.builder.tokenizer import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED

SPACE = "\u2581"


class ReferenceSPM:
    """llama.cpp's SPM path: split out special pieces (longest first), prefix a space where llama.cpp does,
    escape spaces, merge the best-scoring adjacent pair (leftmost on ties) until none forms a piece, and
    spell what no piece covers as <0xNN> bytes."""

    def __init__(self, tokens: list[str], scores: list[float], types: list[int], *, bos_id: int,
                 add_bos: bool, add_space_prefix: bool) -> None:
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.scores, self.bos_id, self.add_bos, self.add_space_prefix = scores, bos_id, add_bos, add_space_prefix
        specials = (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)
        self.specials = sorted((t for t, ty in zip(tokens, types) if ty in specials), key=len, reverse=True)
        self.byte_ids = {int(t[3:5], 16): i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == TOKEN_BYTE}

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        out = [self.bos_id] if add_special and self.add_bos else []
        prev_special = True
        for piece in self._partition(text):
            if isinstance(piece, int):
                out.append(piece)
                prev_special = True
                continue
            raw = (" " if self.add_space_prefix and prev_special else "") + piece
            out += self._spm(raw.replace(" ", SPACE))
            prev_special = False
        return out

    def _partition(self, text: str) -> list[str | int]:
        """Raw text fragments and special token ids, each special found wherever it occurs, longest first."""
        fragments: list[str | int] = [text] if text else []
        for special in self.specials:
            split: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or special not in frag:
                    split.append(frag)
                    continue
                parts = frag.split(special)
                for j, part in enumerate(parts):
                    if part:
                        split.append(part)
                    if j < len(parts) - 1:
                        split.append(self.ids[special])
            fragments = split
        return fragments

    def _spm(self, text: str) -> list[int]:
        symbols = list(text)  # one per character; merged symbols grow, absorbed ones become ""
        nxt = list(range(1, len(symbols))) + [-1]
        prv = list(range(-1, len(symbols) - 1))
        heap: list[tuple[float, int, int, str]] = []

        def add_bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = symbols[left] + symbols[right]
            if merged in self.ids:
                heapq.heappush(heap, (-self.scores[self.ids[merged]], left, right, merged))

        for i in range(1, len(symbols)):
            add_bigram(i - 1, i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != merged:
                continue  # stale: one side was merged elsewhere since
            symbols[left], symbols[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            add_bigram(prv[left], left)
            add_bigram(left, nxt[left])
        out: list[int] = []
        i = 0 if symbols else -1
        while i >= 0:
            sym = symbols[i]
            if sym in self.ids:
                out.append(self.ids[sym])
            else:
                out += [self.byte_ids[b] for b in sym.encode("utf-8")]
            i = nxt[i]
        return out
