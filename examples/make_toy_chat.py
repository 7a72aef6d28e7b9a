"""Write the toy chat corpus that ships with titan-npu (titan_npu/data/corpus/toy_chat.jsonl): 320 short
conversations (sums, next numbers, words spelt backwards, a tool call), some with a system prompt, some multi-turn.
Deterministic: the same file on every run. `python examples/make_toy_chat.py [OUTPUT]`."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "maple", "ocean", "train", "candle", "garden",
         "pencil", "rocket", "silver", "window", "forest", "button", "castle", "dragon"]
SYSTEMS = ["You are a helpful assistant.", "Answer in one short sentence.", "You are a terse assistant."]
CITIES = {"Paris": "sunny, 21 C", "Oslo": "snow, -3 C", "Cairo": "clear, 30 C", "Lima": "cloudy, 18 C"}


def _turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        n = rng.randrange(100)
        return f"What number comes after {n}?", f"{n + 1} comes after {n}."
    word = rng.choice(WORDS)
    return f"Spell {word} backwards.", f"{word} backwards is {word[::-1]}."


def _tool_call(rng: random.Random) -> list[dict]:
    city = rng.choice(sorted(CITIES))
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": f'weather("{city}")'},
            {"role": "tool", "content": CITIES[city]},
            {"role": "assistant", "content": f"In {city} it is {CITIES[city]}."}]


def conversations(n: int = 320, seed: int = 0) -> list[dict]:
    """n conversations: one to three turns, a system prompt in a third of them, a tool call in one in eight."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if i % 3 == 0 else []
        if i % 8 == 7:
            messages += _tool_call(rng)
        else:
            for _ in range(1 + rng.randrange(3)):
                question, answer = _turn(rng)
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append({"messages": messages})
    return out


def write(path: Path) -> Path:
    """The corpus as JSON Lines at path."""
    path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations()), encoding="utf-8")
    return path


if __name__ == "__main__":
    default = Path(__file__).resolve().parent.parent / "titan_npu" / "data" / "corpus" / "toy_chat.jsonl"
    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else default))
