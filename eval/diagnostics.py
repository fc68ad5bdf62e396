"""Paper 004's diagnostics (Sec. 5.2): retrieval across block boundaries by four-candidate NLL ranking, and
prompt-token NLL by position.

Every probe hides one fact in filler text (the run's validation text) and ends with a query whose answer is
one of four candidates; the model is right when the true answer has the lowest summed NLL after the query
(eval/ranking.py). Candidates are balanced: the true answer is each of the four equally often. The facts use
the templates of the embedded corpus's notes (data/embedded.py), so small models trained on it know the
format:

    needle               "The code of the red box is 417." ... "What is the code of the red box? It is"
                         with the code's first token d positions before the readout (the query's last token),
                         d over a distance grid
    bridge_window        the same, with the code in [p - h, p) and the readout in [p, p + h) for a block
                         boundary p: the dependency a bridge window repairs (h = bridge width / 2)
    boundary_sweep       a fixed distance, the code at every signed offset from p in [-h, h) (token resolution;
                         negative: before the boundary)
    boundary_tail        the code in the last quarter of a block, the readout in the second half of the next
    semantic_exact       "Mia keeps the lamp in the blue jar." ... "Mia keeps the lamp in the"
    semantic_paraphrase  ... "Where does Mia keep the lamp? In the"          (the answer: " blue jar")
    semantic_distractor  the paraphrase, with the other candidates stated in facts about other people
    semantic_boundary    the paraphrase in the bridge window's geometry
    prompt_nll           next-token NLL of every prompt position, in 16-token bins, over the needle prompts
                         (Fig. 5a) and over the boundary-focused prompts of the boundary probes (Fig. 5b)

Sample sizes default to the paper's per seed (PAPER_PROMPTS: 1,600 needle prompts, 400 bridge-window prompts,
1,600 for each single-fact semantic probe, so Table 9's pair counts and p-values are comparable), spread evenly
over a probe's cells; `samples` > 0 asks that many per cell instead.

That is the `notes` format. Runs trained on the recall corpus (data/recall.py, e.g. recall_near) are asked in
its `recall` format instead, the fact "#k=V|" hidden in the corpus's counting digits and the query "?k>" read
out on the answer marker, with four value letters as candidates; only the probes of geometry (needle,
bridge_window, boundary_sweep, boundary_tail, prompt_nll) exist in that format.

Examples are a pure function of (seed, probe, index): every model evaluated with the same settings sees the
same prompts, so runs pair up example by example (scripts/compare.py --paired A B --task diagnostics --by probe).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from data import recall
from data.embedded import COLORS, CONTAINERS, NAMES, THINGS
from eval.ranking import continuation_logprobs, length_batches
from common.progress import progress_bar

GEOMETRY_PROBES = ("needle", "bridge_window", "boundary_sweep", "boundary_tail")
PROBES = GEOMETRY_PROBES + ("semantic_exact", "semantic_paraphrase", "semantic_distractor", "semantic_boundary")
FORMATS = {"notes": PROBES, "recall": GEOMETRY_PROBES}  # the probes each format can ask
CANDIDATES = 4
NLL_BIN = 16
# prompts per probe and seed in the paper (004 Table 9: 1,200 bridge-window pairs over 3 seeds, 4,800 needle,
# 9,600 clean semantic = exact + paraphrase); the probes the paper does not count get the bridge window's 400
PAPER_PROMPTS = {"needle": 1600, "bridge_window": 400, "boundary_sweep": 400, "boundary_tail": 400,
                 "semantic_exact": 1600, "semantic_paraphrase": 1600, "semantic_distractor": 1600,
                 "semantic_boundary": 400}
BOUNDARY_PROBES = ("bridge_window", "boundary_sweep", "boundary_tail", "semantic_boundary")


@dataclass
class Geometry:
    """Where probes put their facts: context length, block size and bridge half-width (the same for every
    model compared, whatever its attention)."""

    length: int
    block: int
    half: int

    @property
    def boundaries(self) -> list[int]:
        return list(range(self.block, self.length - self.half + 1, self.block))


def _code_fact(rng, fact_format: str = "notes"):
    """(text before the answer, the candidate answers with the true one first, text after it, the query)."""
    if fact_format == "recall":
        key, values = rng.choice(recall.KEYS), rng.sample(recall.VALUES, CANDIDATES)
        return f"#{key}=", values, "|", f"{recall.QUERY}{key}{recall.ANSWER}"
    color, container = rng.choice(COLORS), rng.choice(CONTAINERS)
    codes = rng.sample(range(100, 1000), CANDIDATES)
    return (f"\nThe code of the {color} {container} is", [f" {c}" for c in codes], ".\n",
            f"\nWhat is the code of the {color} {container}? It is")


def _keeper_fact(rng, paraphrase: bool):
    keeper, thing, container = rng.choice(NAMES)[0], rng.choice(THINGS), rng.choice(CONTAINERS)
    colors = rng.sample(COLORS, CANDIDATES)
    query = f"\nWhere does {keeper} keep the {thing}? In the" if paraphrase else f"\n{keeper} keeps the {thing} in the"
    return (f"\n{keeper} keeps the {thing} in the", [f" {c} {container}" for c in colors], ".\n", query,
            (keeper, thing, container))


def haystack(fact_format: str, tokenizer, text: np.ndarray) -> np.ndarray:
    """The filler facts are hidden in: the run's text (`text`), or for the recall format the corpus's own
    counting digits (its text holds other facts, which would be distractors)."""
    if fact_format == "recall":
        return np.array(tokenizer.encode(string.digits * 1000))
    return text


class Builder:
    """Places a fact in filler so that its answer's first token and the query's last token land exactly where a
    probe asks."""

    def __init__(self, tokenizer, haystack: np.ndarray):
        self.tok, self.haystack = tokenizer, haystack

    def filler(self, rng, n: int) -> list[int]:
        if n <= 0:
            return []
        start = rng.randrange(0, max(1, len(self.haystack) - n))
        out = list(self.haystack[start:start + n])
        return out + list(np.resize(self.haystack, n - len(out)))

    def min_distance(self, fact) -> int:
        """The shortest distance from the answer's first token to the readout this fact's texts allow."""
        _, answers, post, query = fact[:4]
        longest = max(len(self.tok.encode(a)) for a in answers)
        return longest + len(self.tok.encode(post)) + len(self.tok.encode(query))

    def build(self, rng, fact, answer_pos: int, readout: int, extra_facts=()) -> tuple[list[int], list[list[int]]]:
        """Context ids whose last token (the query's) sits at `readout`, with the true answer (index 0 of the
        fact's answers) starting at `answer_pos`; extra facts (token lists) go into the filler at random."""
        pre, answers, post, query = fact[:4]
        pre_ids, post_ids, query_ids = self.tok.encode(pre), self.tok.encode(post), self.tok.encode(query)
        answer_ids = self.tok.encode(answers[0])
        before = answer_pos - len(pre_ids)
        gap = readout + 1 - answer_pos - len(answer_ids) - len(post_ids) - len(query_ids)
        if before < 0 or gap < 0:
            raise ValueError("the fact does not fit at that position")
        prefix_ids, gap_ids = self.filler(rng, before), self.filler(rng, gap)
        extra = [t for fact_ids in extra_facts for t in fact_ids]
        if extra:  # the distractor facts, whole and together, before the fact or between it and the query
            region = prefix_ids if len(extra) <= len(prefix_ids) else gap_ids
            if len(extra) > len(region):
                raise ValueError("no room for the distractor facts")
            at = rng.randrange(0, len(region) - len(extra) + 1)
            region[at:at + len(extra)] = extra
        context = prefix_ids + pre_ids + answer_ids + post_ids + gap_ids + query_ids
        assert len(context) == readout + 1
        return context, [self.tok.encode(a) for a in answers]


def _balanced(answers: list, index: int) -> tuple[list, int]:
    """Rotate the candidates so that the true one (first) sits at index % 4: each position equally often."""
    k = index % len(answers)
    rotated = answers[1:k + 1] + [answers[0]] + answers[k + 1:]
    return rotated, k


def cell_samples(total: int, cells: int, cell: int) -> int:
    """Cell `cell`'s share when `total` prompts are spread evenly over `cells` cells."""
    return total // cells + (cell < total % cells)


def make_examples(builder: Builder, geometry: Geometry, probe: str, samples: int, seed: int,
                  distances: list[int], fact_format: str = "notes") -> list[dict]:
    """`samples` examples per cell (distance, offset or boundary) of one probe; samples 0: the paper's number of
    prompts for the probe (PAPER_PROMPTS), spread over its cells."""
    if probe not in FORMATS[fact_format]:
        raise ValueError(f"probe {probe} has no {fact_format} form: expected one of {', '.join(FORMATS[fact_format])}")
    g, out = geometry, []
    b, h, L = g.block, g.half, g.length
    if probe == "needle" or probe.startswith("semantic_") and probe != "semantic_boundary":
        cells = [("d", d) for d in distances if d < L]
    elif probe == "boundary_sweep":
        cells = [("offset", o) for o in range(-h, h)]
    else:
        cells = [("window", 0)]
    for position, (cell_name, cell) in enumerate(cells):
        for i in range(samples or cell_samples(PAPER_PROMPTS[probe], len(cells), position)):
            rng = random.Random(f"{seed}/{probe}/{cell}/{i}")
            if probe.startswith("semantic_"):
                fact = _keeper_fact(rng, paraphrase=probe != "semantic_exact")
            else:
                fact = _code_fact(rng, fact_format)
            low = builder.min_distance(fact)
            # boundaries with room for the fact's opening words before the earliest answer position
            room = len(builder.tok.encode(fact[0]))
            boundaries = [x for x in g.boundaries if x - max(h, b // 4) - room >= 0] or g.boundaries
            if probe in ("needle", "semantic_exact", "semantic_paraphrase", "semantic_distractor"):
                distance = max(cell, low)
                readout = L - 1
                answer_pos = readout - distance
            elif probe in ("bridge_window", "semantic_boundary"):  # answer in [p - h, p), readout in [p, p + h)
                if low >= 2 * h:
                    raise ValueError(f"the {probe} fact needs {low} positions, more than the bridge window 2 x {h}")
                p = rng.choice(boundaries)
                readout = p + rng.randrange(max(0, low - h), h)
                answer_pos = rng.randrange(max(p - h, readout - 2 * h + 1), min(p, readout - low + 1))
            elif probe == "boundary_sweep":
                p = rng.choice([x for x in boundaries if x + cell + low + 4 < L] or boundaries)
                answer_pos, readout = p + cell, p + cell + low + 4
            else:  # boundary_tail
                p = rng.choice([x for x in boundaries if x + b <= L] or boundaries)
                answer_pos = rng.randrange(p - b // 4, p)
                readout = max(answer_pos + low, rng.randrange(p + b // 2, min(L, p + b)))
            extra = []
            if probe == "semantic_distractor":  # the other candidates, each in a fact about someone else
                keeper, thing, container = fact[4]
                others = [n for n, _ in NAMES if n != keeper]
                for answer in fact[1][1:]:
                    extra.append(builder.tok.encode(f"\n{rng.choice(others)} keeps the {rng.choice(THINGS)} in "
                                                    f"the{answer}.\n"))
            if answer_pos < 0 or readout >= L:
                continue
            try:
                context, candidates = builder.build(rng, fact, answer_pos, readout, extra)
            except ValueError:  # no room at this distance: the same example is skipped for every model
                continue
            candidates, answer = _balanced(candidates, i)
            boundary = round(answer_pos / b) * b
            out.append({"id": f"{probe}/{cell_name}={cell}/{i}", "probe": probe, "context": context,
                        "candidates": candidates, "answer": answer, "distance": readout - answer_pos,
                        "offset": answer_pos - boundary, "readout": readout, cell_name: cell})
    return out


@torch.no_grad()
def score(model, examples: list[dict], batch_size: int) -> list[dict]:
    pairs = [(e["context"], c) for e in examples for c in e["candidates"]]
    scores = continuation_logprobs(model, pairs, batch_size)
    records = []
    for i, e in enumerate(examples):
        nll = [-s["logprob"] for s in scores[CANDIDATES * i:CANDIDATES * (i + 1)]]
        record = {k: v for k, v in e.items() if k not in ("context", "candidates")}
        records.append({**record, "correct": min(range(CANDIDATES), key=nll.__getitem__) == e["answer"]})
    return records


@torch.no_grad()
def prompt_nll(model, contexts: list[list[int]], batch_size: int) -> list[dict]:
    """Mean next-token NLL by position over prompts (of any lengths: each position averages the prompts that
    reach it), in bins of NLL_BIN positions; bin_start is the first predicted position of the bin."""
    device = next(model.parameters()).device
    width = max((len(c) for c in contexts), default=1) - 1
    total, count = torch.zeros(width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64)
    for batch in length_batches([len(c) for c in contexts], batch_size, pad=False):  # no padding: exact positions
        x = torch.tensor([contexts[i] for i in batch], device=device)
        logits, _ = model(x[:, :-1])
        nll = F.cross_entropy(logits.float().transpose(1, 2), x[:, 1:], reduction="none").sum(0)
        total[:nll.shape[0]] += nll.double().cpu()
        count[:nll.shape[0]] += x.shape[0]
    per_position = total / count.clamp(min=1)  # position t predicts token t + 1
    return [{"bin_start": s + 1, "nll": float(per_position[s:s + NLL_BIN][count[s:s + NLL_BIN] > 0].mean()),
             "prompts": int(count[s])} for s in range(0, width, NLL_BIN) if count[s] > 0]


def run(model, tokenizer, text: np.ndarray, geometry: Geometry, probes, samples: int, seed: int,
        distances: list[int], batch_size: int = 8, progress: bool = True, fact_format: str = "notes") -> dict:
    builder = Builder(tokenizer, haystack(fact_format, tokenizer, text))
    rows, per_example, nll_rows, boundary_prompts = [], [], [], []
    for probe in progress_bar(probes, progress, desc="diagnostics"):
        examples = make_examples(builder, geometry, probe, samples, seed, distances, fact_format)
        records = score(model, examples, batch_size)
        per_example += records
        accuracy = sum(r["correct"] for r in records) / max(1, len(records))
        rows.append({"probe": probe, "cell": "all", "n": len(records), "accuracy": accuracy})
        cell_key = "d" if records and "d" in records[0] else "offset" if probe == "boundary_sweep" else None
        if cell_key:
            for value in sorted({r[cell_key] for r in records}):
                cell = [r for r in records if r[cell_key] == value]
                rows.append({"probe": probe, "cell": f"{cell_key}={value}", "n": len(cell),
                             "accuracy": sum(r["correct"] for r in cell) / len(cell)})
        if probe == "needle":
            full_length = [e["context"] for e in examples if len(e["context"]) == geometry.length]
            nll_rows = prompt_nll(model, full_length, batch_size)
        if probe in BOUNDARY_PROBES:
            boundary_prompts += [e["context"] for e in examples]
    return {"rows": rows, "prompt_nll": nll_rows, "prompt_nll_boundary": prompt_nll(model, boundary_prompts, batch_size)
            if boundary_prompts else [], "per_example": per_example, "format": fact_format,
            "geometry": {"length": geometry.length, "block": geometry.block, "half": geometry.half}}
