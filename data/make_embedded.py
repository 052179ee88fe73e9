"""Build the embedded default: a sample instruction dataset, a tokenizer trained on it, and a tiny
Llama-architecture model with random weights (fixed seeds throughout).

Everything it writes is committed, so a run needs neither this script nor a network; run it again
only to change the embedded default:

    python data/make_embedded.py            # rewrites data/sample/ and data/tiny-llama/

The dataset is generated from templates and word lists written for this project: no text is copied
from elsewhere. The tasks are formulaic on purpose, so that a model of ~1M parameters can learn them
in a few hundred steps on a laptop CPU and the tuned eval loss falls clearly below the base one.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 1234
N_EXAMPLES = 3000

OPPOSITES = [
    ("hot", "cold"), ("tall", "short"), ("fast", "slow"), ("early", "late"), ("full", "empty"),
    ("open", "closed"), ("light", "dark"), ("loud", "quiet"), ("wet", "dry"), ("hard", "soft"),
    ("rich", "poor"), ("young", "old"), ("strong", "weak"), ("clean", "dirty"), ("thick", "thin"),
    ("happy", "sad"), ("near", "far"), ("up", "down"), ("inside", "outside"), ("first", "last"),
    ("cheap", "expensive"), ("heavy", "light"), ("wide", "narrow"), ("sweet", "sour"),
    ("brave", "afraid"), ("push", "pull"), ("buy", "sell"), ("win", "lose"), ("give", "take"),
    ("begin", "end"), ("arrive", "leave"), ("remember", "forget"), ("accept", "refuse"),
]
PLURALS = [
    ("cat", "cats"), ("box", "boxes"), ("city", "cities"), ("child", "children"), ("mouse", "mice"),
    ("leaf", "leaves"), ("tooth", "teeth"), ("bus", "buses"), ("baby", "babies"), ("knife", "knives"),
    ("sheep", "sheep"), ("person", "people"), ("glass", "glasses"), ("story", "stories"),
    ("wolf", "wolves"), ("man", "men"), ("woman", "women"), ("foot", "feet"), ("goose", "geese"),
    ("potato", "potatoes"), ("hero", "heroes"), ("key", "keys"), ("toy", "toys"), ("day", "days"),
    ("bench", "benches"), ("wish", "wishes"), ("lady", "ladies"), ("shelf", "shelves"),
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
        "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
COLORS = [("banana", "yellow"), ("grass", "green"), ("snow", "white"), ("coal", "black"),
          ("a ripe tomato", "red"), ("a clear sky", "blue"), ("an orange", "orange"),
          ("a plum", "purple"), ("a lemon", "yellow"), ("a crow", "black"), ("milk", "white"),
          ("a lime", "green"), ("a strawberry", "red"), ("the ocean", "blue")]
ANIMALS = [("dog", "bark"), ("cat", "meow"), ("cow", "moo"), ("duck", "quack"), ("sheep", "baa"),
           ("lion", "roar"), ("owl", "hoot"), ("horse", "neigh"), ("snake", "hiss"), ("bee", "buzz"),
           ("frog", "croak"), ("pig", "oink")]


def number_words(n: int) -> str:
    """Spell 0..99 in English words."""
    if n < 20:
        return ONES[n]
    tens, ones = divmod(n, 10)
    return TENS[tens] + ("" if ones == 0 else "-" + ONES[ones])


def _opposite(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.choice(OPPOSITES)
    if rng.random() < 0.5:
        a, b = b, a
    q = rng.choice(["What is the opposite of {w}?", "Give the opposite of the word {w}.",
                    "Name a word that means the opposite of {w}."]).format(w=a)
    return q, "", f"The opposite of {a} is {b}."


def _plural(rng: random.Random) -> tuple[str, str, str]:
    one, many = rng.choice(PLURALS)
    q = rng.choice(["What is the plural of {w}?", "Write the plural form of {w}."]).format(w=one)
    return q, "", f"The plural of {one} is {many}."


def _addition(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    q = rng.choice(["Add {a} and {b}.", "What is {a} plus {b}?", "Compute the sum of {a} and {b}."])
    return q.format(a=a, b=b), "", f"{a} plus {b} equals {a + b}."


def _larger(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.sample(range(100), 2)
    q = rng.choice(["Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?"])
    return q.format(a=a, b=b), "", f"{max(a, b)} is larger than {min(a, b)}."


def _spell(rng: random.Random) -> tuple[str, str, str]:
    n = rng.randint(0, 99)
    q = rng.choice(["Write the number {n} in words.", "How do you spell {n} in English?"])
    return q.format(n=n), "", f"{n} is written as {number_words(n)}."


def _next_day(rng: random.Random) -> tuple[str, str, str]:
    i = rng.randrange(7)
    q = rng.choice(["Which day comes after {d}?", "Name the day after {d}."]).format(d=DAYS[i])
    return q, "", f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}."


def _prev_month(rng: random.Random) -> tuple[str, str, str]:
    i = rng.randrange(12)
    q = rng.choice(["Which month comes before {m}?", "Name the month before {m}."])
    return q.format(m=MONTHS[i]), "", f"The month before {MONTHS[i]} is {MONTHS[i - 1]}."


def _color(rng: random.Random) -> tuple[str, str, str]:
    thing, color = rng.choice(COLORS)
    return f"What color is {thing}?", "", f"The color of {thing} is usually {color}."


def _animal(rng: random.Random) -> tuple[str, str, str]:
    animal, sound = rng.choice(ANIMALS)
    q = rng.choice(["What sound does a {a} make?", "How does a {a} sound?"]).format(a=animal)
    return q, "", f"A {animal} says {sound}."


def _sort(rng: random.Random) -> tuple[str, str, str]:
    nums = rng.sample(range(1, 60), rng.randint(3, 6))
    context = ", ".join(map(str, nums))
    q = rng.choice(["Sort the numbers in the context from smallest to largest.",
                    "Put the numbers given in the context in increasing order."])
    return q, context, ", ".join(map(str, sorted(nums))) + "."


def _count(rng: random.Random) -> tuple[str, str, str]:
    words = [rng.choice(OPPOSITES)[rng.randrange(2)] for _ in range(rng.randint(2, 9))]
    n = len(words)
    return ("How many words are in the context?", " ".join(words),
            f"The context has {number_words(n)} words.")


FAMILIES = [_opposite, _plural, _addition, _larger, _spell, _next_day, _prev_month, _color,
            _animal, _sort, _count]


def make_examples(n: int, seed: int) -> list[dict[str, str]]:
    """n Dolly-style records (instruction, context, response, category) from a fixed seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        family = rng.choice(FAMILIES)
        instruction, context, response = family(rng)
        rows.append({"instruction": instruction, "context": context, "response": response,
                     "category": family.__name__.lstrip("_")})
    return rows


def train_tokenizer(texts: list[str], out: Path, vocab_size: int = 1024) -> None:
    """Byte-level BPE trained on the sample texts, saved in transformers format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=512)
    fast.save_pretrained(out)


def build_tiny_llama(out: Path, seed: int) -> None:
    """A ~1M-parameter Llama with random weights and the config committed beside it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    a = ap.parse_args()
    rows = make_examples(N_EXAMPLES, SEED)
    sample = a.out / "sample" / "instructions.jsonl"
    sample.parent.mkdir(parents=True, exist_ok=True)
    sample.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the section headers of the prompt templates belong to the tokenizer's corpus too
    texts = [f"### Instruction:\n{r['instruction']}\n\n### Context:\n{r['context']}\n\n"
             f"### Response:\n{r['response']}" for r in rows]
    model_dir = a.out / "tiny-llama"
    train_tokenizer(texts, model_dir)
    build_tiny_llama(model_dir, SEED)
    print(f"wrote {sample} ({len(rows)} examples) and {model_dir}")


if __name__ == "__main__":
    main()
