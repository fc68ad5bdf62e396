"""RULER's needle-in-a-haystack subtasks (Hsieh et al. 2024; paper 003's Table 4 and Fig. 5), generated on the fly.

The eight retrieval subtasks of RULER's synthetic.yaml, with its templates, needle and haystack types:

    subtask            haystack  key    value   keys  values per key  keys asked
    niah_single_1      noise     word   number  1     1               1
    niah_single_2      essay     word   number  1     1               1
    niah_single_3      essay     word   uuid    1     1               1
    niah_multikey_1    essay     word   number  4     1               1
    niah_multikey_2    needle    word   number  1     1               1
    niah_multikey_3    needle    uuid   uuid    1     1               1
    niah_multivalue    essay     word   number  1     4               1
    niah_multiquery    essay     word   number  4     1               4

Every prompt is RULER's, character for character, given its haystack and draws: the template, the needle
sentence, the answer prefix a base model continues ("... mentioned in the provided text is"), put in the singular
("A special magic number is hidden ...") when one value is expected, and RULER's generate_input_output's way of
inserting needles and joining the haystack. `noise` repeats "The grass is green. ..." one per line (RULER's
noise, lm_eval's repeat); `needle` is distractor needles with other keys, one per line; both take the needles at
lines drawn from the haystack's. `essay` is natural text split into sentences (RULER uses Paul Graham's essays
and nltk's sentence splitter; here the validation split of the evaluated run's data, the embedded corpus or a
local text file, split at sentence-ending punctuation), the needles going between sentences at depths drawn from
RULER's 40, pieces joined by spaces. Queries for several keys are listed in RULER's drawn order ("k1, k2, k3, and
k4"). `depths` instead moves the first asked needle to that fraction of the haystack (a depth sweep, not RULER's).
The haystack grows (binary search on its size in sentences or lines, as RULER's on its size in words or lines)
until the prompt takes at most `length - gen_tokens` tokens of the evaluated model's tokenizer.

Scores:
    score (RULER's)  greedy generation of gen_tokens tokens (KV cache), then RULER's string_match_all: the share
                     of the expected values that appear in the output, case-insensitively (partial credit for the
                     multi-value and multi-query subtasks); `correct` when all of them appear
    rank (second)    each expected value must have a lower NLL than every one of `candidates - 1` distractor
                     values of its type (candidate ranking, eval/ranking.py), a measure models too small to
                     generate the answer still register
Keys are adjective-noun pairs from this module's lists (RULER draws them from wonderwords' lists), distinct within
an example and never reused by a distractor needle. Examples are a pure function of (seed, subtask, length,
depth, index). tests/runs/test_niah_templates.py builds the same examples with lm_eval's copy of RULER's code.
"""

from __future__ import annotations

import random
import re
import uuid

import numpy as np
import torch

from eval.ranking import continuation_logprobs, length_batches
from common.progress import progress_bar

# RULER's synthetic.yaml, retrieval family: haystack, key type, value type, keys, values per key, keys asked
SUBTASKS = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}
KINDS = tuple(SUBTASKS)
# RULER's strings, character for character (NVIDIA/RULER scripts/data/synthetic/constants.py and niah.py;
# lm_eval/tasks/ruler/niah_utils.py and prepare_niah.py): tests/runs/test_niah_templates.py checks them
# against lm_eval's
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
            "{type_needle_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]  # RULER's needle depths (%)
RULER_SEED = 42  # RULER shuffles every example's needles with random.Random(random_seed), its fixed seed
GEN_TOKENS = 128  # RULER's tokens_to_generate for niah
# 1: this module's own wording ("a special magic number is hidden") and placement; 2: RULER's exact prompts.
# Part of every example id, so examples of two versions are never paired as the same example
PROMPT_VERSION = 2
ADJECTIVES = ["amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "ivory", "jolly",
              "keen", "lucky", "mellow", "noble", "olive", "proud", "quiet", "rusty", "silver", "tidy",
              "vivid", "wild", "young", "zesty"]
NOUNS = ["anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchid", "pepper", "quarry", "rocket", "saddle", "tunnel",
         "umbrella", "violin", "walrus", "yarrow"]
WORDS = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def random_item(kind: str, rng: random.Random, digits: int = 7) -> str:
    """A key or value of RULER's types, drawn as RULER's generate_random draws it (so one seeded stream gives
    RULER's draws): an adjective-noun word pair, a uuid4, or a number of `digits` digits."""
    if kind == "words":
        return rng.choice(WORDS)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def prompt_template(expected_values: int) -> str:
    """RULER's prompt for a base model: the template, then the answer prefix, put in the singular as RULER's
    niah.py does when one value is expected (the format's type_needle_v is then the singular too)."""
    template = TEMPLATE + ANSWER_PREFIX
    if expected_values == 1:
        template = template.replace("Some", "A")
        template = template.replace("are all", "is")
        template = template.replace("are", "is")
    return template


def haystack_sentences(text: str) -> list[str]:
    """Natural text as sentences (the essay haystack's units)."""
    return [s for s in SENTENCE_END.split(" ".join(text.split())) if s]


def example_seed(seed: int, kind: str, length: int, depth: float | None, index: int) -> str:
    """The seed of one example's random stream: every haystack size tried for it draws the same keys and values."""
    return f"{seed}/{kind}/{length}/{depth}/{index}"


def ruler_prompt(kind: str, essay: list[str], size: int, rng: random.Random, depth: float | None = None,
                 digits: int = 7) -> tuple[str, list[str]]:
    """RULER's generate_input_output for a base model with `size` haystack units (essay sentences, noise lines or
    distractor needles): (prompt ending in the answer prefix, expected values in RULER's order). Draws from rng in
    RULER's order, so rng seeded as RULER's global random gives RULER's prompt. Two departures, both no-ops when
    no draw collides: keys are distinct, and distractor needles never use an example's key (this key list is
    small; RULER's is large enough that it never needs to). depth (a depth sweep, not RULER's) moves the first
    asked needle to that fraction of the haystack after every draw is made."""
    haystack, type_k, type_v, n_keys, n_values, n_asked = SUBTASKS[kind]
    keys, values, needles = [], [], []
    for _ in range(n_keys):
        key = random_item(type_k, rng, digits)
        while key in keys:
            key = random_item(type_k, rng, digits)
        keys.append(key)
        value = []
        for _ in range(n_values):
            value.append(random_item(type_v, rng, digits))
            needles.append(NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=value[-1]))
        values.append(value)
    random.Random(RULER_SEED).shuffle(needles)

    if haystack == "essay":
        if not essay:
            raise ValueError("the essay haystack is empty: give natural text (niah_haystack)")
        document_sents = [essay[i % len(essay)] for i in range(size)]  # the text again from its start if need be
        # RULER's float expression (len * (depth / 100)), kept as is: it rounds differently from len * depth / 100
        positions = sorted([int(len(document_sents) * (d / 100)) for d in rng.sample(DEPTHS, len(needles))])
        placed = list(zip(positions, needles))
    else:
        if haystack == "noise":
            sentences = [NOISE] * size
        else:
            sentences = []
            for _ in range(size):  # key before value, as RULER's format call evaluates them
                key = random_item(type_k, rng, digits)
                while key in keys:
                    key = random_item(type_k, rng, digits)
                sentences.append(NEEDLE.format(type_needle_v=type_v, key=key, value=random_item(type_v, rng, digits)))
        placed = list(zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles))

    indices = rng.sample(range(n_keys), n_asked)
    queries = [keys[i] for i in indices]
    answers = [a for i in indices for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

    if depth is not None:
        first = needles.index(NEEDLE.format(type_needle_v=type_v, key=queries[0], value=answers[0]))
        units = len(document_sents) if haystack == "essay" else size
        placed[first] = (int(round(depth * units)), needles[first])
        # the order each construction below assumes (stable: RULER's own pairs keep theirs)
        placed.sort(key=lambda p: p[0], reverse=haystack != "essay")

    if haystack == "essay":  # RULER joins the pieces with spaces, empty ones too (two spaces between needles)
        bounds = [0] + [p for p, _ in placed] + [len(document_sents)]
        pieces = []
        for i in range(1, len(bounds)):
            pieces.append(" ".join(document_sents[bounds[i - 1]:bounds[i]]))
            if i - 1 < len(placed):
                pieces.append(placed[i - 1][1])
        context = " ".join(pieces)
    else:  # inserted from the last position back, so every index is one of the original lines
        for index, needle in placed:
            sentences.insert(index, needle)
        context = "\n".join(sentences)

    one = n_asked * n_values == 1
    prompt = prompt_template(n_asked * n_values).format(type_needle_v=type_v[:-1] if one else type_v,
                                                         context=context, query=query)
    return prompt, answers


def make_example(tokenizer, essay: list[str], kind: str, length: int, depth: float | None, index: int, seed: int,
                 digits: int = 7, candidates: int = 4, gen_tokens: int = GEN_TOKENS) -> dict:
    """One example: prompt token ids (at most length - gen_tokens), expected values, distractor values, and the
    haystack size (units) the prompt was built with."""
    if kind not in SUBTASKS:
        raise ValueError(f"unknown niah subtask {kind!r}: expected one of {', '.join(KINDS)}")
    haystack, type_k, type_v, n_keys, n_values, n_asked = SUBTASKS[kind]
    name = example_seed(seed, kind, length, depth, index)

    def tokens(size: int) -> int:
        return len(tokenizer.encode(ruler_prompt(kind, essay, size, random.Random(name), depth, digits)[0]))

    budget = length - gen_tokens
    # RULER samples the needles' lines from the haystack's: at least one line per needle
    low = 0 if haystack == "essay" else n_keys * n_values
    limit = 1 << 22
    if tokens(low) > budget:
        raise ValueError(f"niah length {length} leaves {budget} tokens for the prompt after {gen_tokens} generated, "
                         f"too few for {kind}'s template and needles")
    high = max(1, 2 * low)
    while high < limit and tokens(high) <= budget:
        low, high = high, min(2 * high, limit)
    if high == limit and tokens(high) <= budget:
        low = high
    while high - low > 1:  # largest haystack that fits, as RULER's binary search
        middle = (low + high) // 2
        low, high = (middle, high) if tokens(middle) <= budget else (low, middle)
    prompt, expected = ruler_prompt(kind, essay, low, random.Random(name), depth, digits)
    ids = tokenizer.encode(prompt)
    rng = random.Random(f"{name}/distractors")
    used = set(expected)
    distractors = []
    while len(distractors) < candidates - 1:
        value = random_item(type_v, rng, digits)
        if value not in used and value not in prompt:  # not the value of any needle either
            used.add(value)
            distractors.append(value)
    return {"id": f"{kind}/L={length}/d={'ruler' if depth is None else depth}/i={index}/p{PROMPT_VERSION}",
            "kind": kind, "length": length, "depth": depth, "context": ids, "expected": expected,
            "distractors": distractors, "haystack_size": low}


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's niah metric for one example: the share of references found in the prediction (case-insensitive).
    lm_eval first cleans the prediction (postprocess_pred: control characters to newlines, ends stripped), which
    cannot change whether a value without whitespace or control characters is found, so it is left out."""
    return sum(reference.lower() in prediction.lower() for reference in references) / len(references)


@torch.no_grad()
def score_examples(model, tokenizer, examples: list[dict], batch_size: int = 8, gen_tokens: int = GEN_TOKENS,
                   generate: bool = True) -> list[dict]:
    """RULER's generation score and the candidate-ranking score of each example."""
    device = next(model.parameters()).device
    records = [None] * len(examples)
    for indices in length_batches([len(e["context"]) for e in examples], batch_size, pad=False):
        batch = [examples[i] for i in indices]
        texts = [None] * len(batch)
        if generate:  # equal-length prompts: one batched greedy decode over the KV cache
            x = torch.tensor([e["context"] for e in batch], device=device)
            out = model.generate(x, gen_tokens, temperature=0, use_cache=True)[:, x.shape[1]:]
            texts = [tokenizer.decode(ids) for ids in out.tolist()]
        pairs = [(e["context"], tokenizer.encode(" " + value)) for e in batch
                 for value in e["expected"] + e["distractors"]]
        scores = iter(continuation_logprobs(model, pairs, batch_size))
        for i, e, text in zip(indices, batch, texts):
            nll = {v: -next(scores)["logprob"] for v in e["expected"] + e["distractors"]}
            rank_ok = all(nll[v] < nll[d] for v in e["expected"] for d in e["distractors"])
            score = string_match_all(text, e["expected"]) if text is not None else None
            records[i] = {"id": e["id"], "kind": e["kind"], "length": e["length"], "depth": e["depth"],
                          "score": score, "correct": score == 1.0 if score is not None else rank_ok,
                          "correct_rank": rank_ok, "generated": text}
    return records


def run(model, tokenizer, essay_text: str, lengths, depths, kinds, samples: int, seed: int, batch_size: int = 8,
        digits: int = 7, candidates: int = 4, progress: bool = True, gen_tokens: int = GEN_TOKENS,
        generate: bool = True) -> dict:
    """Every (subtask, length, depth) cell with `samples` examples (depths None: RULER's random placement):
    rows of scores, one "average" row per length over the subtasks (RULER's and paper 003's Table 4 average),
    and per-example records, with the version of the prompts they were asked (PROMPT_VERSION)."""
    limit = model.config.block_size if model.wpe is not None else None
    essay = haystack_sentences(essay_text)
    rows, per_example = [], []
    cells = [(k, L, d) for L in lengths for k in kinds for d in (depths or [None])]
    for kind, length, depth in progress_bar(cells, progress, desc="niah"):
        if limit is not None and length > limit:
            rows.append({"kind": kind, "length": length, "depth": depth, "n": 0, "score": None, "acc_rank": None,
                         "note": f"longer than block_size {limit} (learned positions cannot extrapolate: a run "
                                 "trained with --pos_embedding=rope can be scored at any length)"})
            continue
        try:
            examples = [make_example(tokenizer, essay, kind, length, depth, i, seed, digits, candidates, gen_tokens)
                        for i in range(samples)]
        except ValueError as err:  # the template and needles do not fit: a skipped cell, not a failed run
            rows.append({"kind": kind, "length": length, "depth": depth, "n": 0, "score": None, "acc_rank": None,
                         "note": str(err)})
            continue
        records = score_examples(model, tokenizer, examples, batch_size, gen_tokens, generate)
        per_example += records
        rows.append({"kind": kind, "length": length, "depth": depth, "n": len(records),
                     "score": float(np.mean([r["score"] for r in records])) if generate else None,
                     "acc_rank": float(np.mean([r["correct_rank"] for r in records]))})
    return {"rows": rows + average_rows(rows), "per_example": per_example, "prompt_version": PROMPT_VERSION}


def average_rows(rows: list[dict]) -> list[dict]:
    """One "average" row per length over the subtasks scored there (when more than one): RULER's average. Also
    recomputed when a later evaluation adds or replaces subtasks at a length (eval/results.py)."""
    out = []
    for length in sorted({r["length"] for r in rows}):
        cell = [r for r in rows if r["length"] == length and r["n"] and r["kind"] != "average"]
        if len({r["kind"] for r in cell}) > 1:
            mean = lambda key: float(np.mean([r[key] for r in cell])) if cell[0][key] is not None else None  # noqa: E731
            out.append({"kind": "average", "length": length, "depth": None, "n": sum(r["n"] for r in cell),
                        "score": mean("score"), "acc_rank": mean("acc_rank")})
    return out
