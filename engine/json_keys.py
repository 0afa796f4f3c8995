"""Keys already used in each open JSON object of a growing output, so constrained decoding can forbid a repeat.

A grammar cannot say "no key twice" for keys it does not list (an open object: ``additionalProperties``, plain
``{"type": "object"}``, json_object mode), so engine.structured_output runs one KeyTracker per constrained
request beside its grammar matcher. Pure Python over bytes; no engine or grammar-library imports.
"""

from __future__ import annotations

import json

# NOTE(engine): a byte-level push scanner, not a JSON library: the mask needs what no incremental parser we know
# exposes (ijson's push parser reports a key only once it is complete): the key being written, a cheap probe of
# "what if this token came next" that leaves the state alone, and a restart after non-JSON text (a tool call
# inside free text). Structural bytes are ASCII and UTF-8 continuation bytes never are, so scanning bytes is
# safe across tokens that split a character; keys are compared decoded (``"a\u0062"`` repeats ``"ab"``).

# Scanner states (what the next byte may be).
TEXT = 0  # outside JSON: only ``{`` starts an object
VALUE = 1  # a value (after ``:`` or ``,`` in an array, or at the start of a JSON-only output)
FIRST_KEY = 2  # after ``{``: a key or ``}``
KEY = 3  # after ``,`` in an object: a key
KEY_STR = 4  # inside a key string
KEY_ESC = 5  # after a backslash in a key string
COLON = 6  # after a key
STR = 7  # inside a value string
STR_ESC = 8  # after a backslash in a value string
ATOM = 9  # inside a number or a literal (true, false, null)
AFTER = 10  # after a value inside a container: ``,`` or the container's close
FIRST_ITEM = 11  # after ``[``: a value or ``]``

_WS = frozenset(b" \t\r\n")
_ATOM_START = frozenset(b"-0123456789tfn")
_ATOM = frozenset(b"+-.0123456789eEtrufalsn")
_QUOTE, _BACKSLASH = 0x22, 0x5C
_OPEN_OBJ, _CLOSE_OBJ, _OPEN_ARR, _CLOSE_ARR, _COMMA, _COLON = b"{}[],:"


def decode_key(raw: bytes) -> str:
    """The text of a key from its raw bytes between the quotes (escapes resolved; bad bytes replaced)."""
    if _BACKSLASH not in raw:
        return raw.decode("utf-8", "replace")
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw.decode("utf-8", "replace")


class KeyTracker:
    """Follows the accepted bytes of one output; tells which next tokens would repeat a key in their object.

    Usage::

        keys = KeyTracker(json_only=True)
        keys.feed(b'{"id":1,"')
        keys.quotes_needed()  # 1: a token with one quote may close the key being written
        keys.closes_repeat(b'id":')  # True: that token would write "id" twice in this object
        keys.closes_repeat(b'ids":')  # False

    Args:
        json_only: the whole output is one JSON value (json_object / json_schema). Otherwise (Lark grammars of
            tool calls, regexes) JSON starts at any ``{`` outside it and ends when that object closes; a byte
            that cannot continue the JSON puts the scanner back to text.
    """

    __slots__ = ("json_only", "_state", "_stack", "_key")

    def __init__(self, json_only: bool) -> None:
        self.json_only = json_only
        self.reset()

    def reset(self) -> None:
        """Back to the start of an output."""
        self._state = VALUE if self.json_only else TEXT
        # NOTE(engine): one frame per open container, innermost last: an object's keys (each with its UTF-8
        # bytes, for closing_heads), None for an array.
        self._stack: list[dict[str, bytes] | None] = []
        self._key = bytearray()  # raw bytes of the key being written (state KEY_STR / KEY_ESC)

    def snapshot(self) -> tuple[int, list[dict[str, bytes] | None], bytes]:
        """The scanner's state as it stands, for ``restore`` (speculative decoding tries draft tokens, then takes
        them back): O(open containers and their keys), not O(output)."""
        return self._state, [None if frame is None else dict(frame) for frame in self._stack], bytes(self._key)

    def restore(self, snapshot: tuple[int, list[dict[str, bytes] | None], bytes]) -> None:
        """Back to where ``snapshot`` was taken."""
        state, stack, key = snapshot
        self._state = state
        self._stack = [None if frame is None else dict(frame) for frame in stack]
        self._key = bytearray(key)

    def restart_text(self) -> None:
        """Leave any JSON being read (a special token such as a tool-call marker came)."""
        self._state = TEXT
        self._stack.clear()

    @property
    def depth(self) -> int:
        """Containers open now."""
        return len(self._stack)

    def keys(self) -> set[str] | None:
        """The keys written so far in the innermost open object (None when the innermost container is not one)."""
        frame = self._stack[-1] if self._stack else None
        return None if frame is None else set(frame)

    def feed(self, data: bytes) -> None:
        """Advance by accepted bytes (one token's)."""
        self._state = self._run(data, self._stack, self._key, None)

    def quotes_needed(self) -> int:
        """The fewest ``"`` bytes a next token must hold to close a key that could repeat one; 0 when no open
        object has a key yet (then no token can repeat one, short of writing a whole object in one token)."""
        if not any(self._stack):
            return 0
        state = self._state
        if state == KEY_STR or state == KEY_ESC:
            return 1
        return 3 if state == STR or state == STR_ESC else 2

    def closes_repeat(self, data: bytes) -> bool:
        """Whether accepting ``data`` next would close a key already written in its object (state unchanged)."""
        found: list[bool] = []
        self._run(data, list(self._stack), bytearray(self._key), found)
        return bool(found)

    def closing_heads(self) -> list[bytes] | None:
        """Inside a key written so far without escapes: the texts that, followed by its closing quote, would
        complete a key already used in this object (each used key that starts with what is written, less that
        start). None elsewhere, or after an escape: then ask ``repeats`` or ``closes_repeat`` per token.

        A token whose text before its first quote is one of these, with no backslash there and no second key
        after it, repeats a key; the mask looks such tokens up by that text instead of probing them one by one.
        """
        if self._state != KEY_STR or _BACKSLASH in self._key:
            return None
        partial = bytes(self._key)
        n = len(partial)
        return [raw[n:] for raw in self._stack[-1].values() if raw.startswith(partial)]

    def repeats(self, tokens: list[bytes]) -> list[int]:
        """The indexes of ``tokens`` that would each, accepted next, close a key already written in its object.

        Equal to ``[i for i, t in enumerate(tokens) if self.closes_repeat(t)]``, with a fast path for the common
        case (the mask's hot loop): inside a key, a token whose first quote ends it and which holds no further
        key is decided by that key's text alone, looked up once per distinct text before the quote.
        """
        if self._state != KEY_STR:
            return [i for i, data in enumerate(tokens) if self.closes_repeat(data)]
        frame = self._stack[-1]
        partial = bytes(self._key)
        decided: dict[bytes, bool] = {}  # text before the quote -> whether that key is used
        found = []
        for i, data in enumerate(tokens):
            q = data.find(b'"')
            head = data[:q]
            # a backslash before the quote may escape it; two more quotes after it may hold another whole key
            if q < 0 or _BACKSLASH in head or data.count(b'"', q + 1) >= 2:
                if self.closes_repeat(data):
                    found.append(i)
                continue
            used = decided.get(head)
            if used is None:
                used = decided[head] = decode_key(partial + head) in frame
            if used:
                found.append(i)
        return found

    # NOTE(engine): one loop serves both feed and the probe. The probe works on a copy of the stack list (its
    # frames shared, never written: keys it closes go to ``added``) and stops at the first repeat.
    def _run(self, data: bytes, stack: list, key: bytearray, found: list | None) -> int:
        state = self._state
        added: set[tuple[int, str]] = set()  # probe only: (id(frame), key) closed earlier in this token
        i, n = 0, len(data)
        while i < n:
            c = data[i]
            i += 1
            if state == KEY_STR:
                if c == _QUOTE:
                    name = decode_key(bytes(key))
                    frame = stack[-1]
                    if found is None:
                        frame[name] = name.encode("utf-8", "surrogatepass")
                    elif name in frame or (id(frame), name) in added:
                        found.append(True)
                        return state
                    else:
                        added.add((id(frame), name))
                    state = COLON
                else:
                    key.append(c)
                    if c == _BACKSLASH:
                        state = KEY_ESC
            elif state == STR:
                if c == _QUOTE:
                    state = AFTER if stack else TEXT
                elif c == _BACKSLASH:
                    state = STR_ESC
            elif c in _WS and state != ATOM:
                if state == KEY_ESC:
                    key.append(c)
                    state = KEY_STR
                elif state == STR_ESC:
                    state = STR
            elif state == KEY_ESC:
                key.append(c)
                state = KEY_STR
            elif state == STR_ESC:
                state = STR
            elif state == TEXT:
                if c == _OPEN_OBJ:
                    stack.append({})
                    state = FIRST_KEY
            elif state == ATOM and c in _ATOM:
                pass
            else:
                if state == ATOM:  # the number or literal ended at this byte: read it as what follows a value
                    state = AFTER if stack else TEXT
                    if state == TEXT or c in _WS:
                        continue
                state = self._structural(state, c, stack, key)
                if state < 0:  # not JSON: back to text
                    if found is not None:
                        return TEXT
                    stack.clear()
                    state = TEXT
        return state

    @staticmethod
    def _structural(state: int, c: int, stack: list, key: bytearray) -> int:
        """The state after structural byte ``c`` (not whitespace, not inside a string); -1 when ``c`` is invalid."""
        if state == VALUE or state == FIRST_ITEM:
            if c == _OPEN_OBJ:
                stack.append({})
                return FIRST_KEY
            if c == _OPEN_ARR:
                stack.append(None)
                return FIRST_ITEM
            if c == _QUOTE:
                return STR
            if c in _ATOM_START:
                return ATOM
            if c == _CLOSE_ARR and state == FIRST_ITEM:
                stack.pop()
                return AFTER if stack else TEXT
            return -1
        if state == FIRST_KEY or state == KEY:
            if c == _QUOTE:
                key.clear()
                return KEY_STR
            if c == _CLOSE_OBJ and state == FIRST_KEY:
                stack.pop()
                return AFTER if stack else TEXT
            return -1
        if state == COLON:
            return VALUE if c == _COLON else -1
        if state == AFTER:
            is_object = stack[-1] is not None
            if c == _COMMA:
                return KEY if is_object else VALUE
            if c == (_CLOSE_OBJ if is_object else _CLOSE_ARR):
                stack.pop()
                return AFTER if stack else TEXT
            return -1
        return -1
