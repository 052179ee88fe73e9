"""Build the sample prompts for GRPO: data/sample/prompts.jsonl (fixed seed, no copied text).

    python data/make_prompts.py        # rewrites data/sample/prompts.jsonl

Each record is a `prompt` in the pipeline's instruction template (as in data/sample/preferences.jsonl) and the
`answer` a reward function can check it against: the sum of two numbers, or the larger of two. The built-in
rewards read it (numeric_match: the answer's last number; format: a pattern such as a digit anywhere), so a tiny
model learns the format reward in a few dozen GRPO steps on a CPU (data/presets/grpo-embedded.yaml).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 2468
N_PROMPTS = 400
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
QUESTIONS = {
    "addition": ["Add {a} and {b}.", "What is {a} plus {b}?", "Compute the sum of {a} and {b}."],
    "larger": ["Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?"],
}


def make_prompts(n: int, seed: int) -> list[dict[str, str]]:
    """n (prompt, answer, category) records with numeric answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        category = rng.choice(sorted(QUESTIONS))
        a, b = rng.sample(range(50), 2)
        answer = a + b if category == "addition" else max(a, b)
        question = rng.choice(QUESTIONS[category]).format(a=a, b=b)
        rows.append({"prompt": PROMPT_TEMPLATE.format(instruction=question), "answer": str(answer),
                     "category": category})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "sample" / "prompts.jsonl")
    a = ap.parse_args()
    rows = make_prompts(N_PROMPTS, SEED)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {a.out} ({len(rows)} prompts)")


if __name__ == "__main__":
    main()
