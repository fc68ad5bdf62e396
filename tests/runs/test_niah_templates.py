"""eval/niah.py's prompts against RULER's own, as lm-evaluation-harness's copy of RULER builds them
(lm_eval/tasks/ruler/prepare_niah.py, niah_utils.py, common_utils.py, and niah_single_1.yaml, which every
niah_*.yaml includes).

Importing those modules cannot work offline: prepare_niah.py needs wonderwords (not installed) for its key list and
downloads nltk's punkt_tab sentence splitter at import, and the essay haystack is a Hugging Face dataset. So the
test reads their source with ast and executes only the definitions that build a prompt and score a generation:
lm_eval's NEEDLE and DEPTHS, generate_random*, generate_input_output and get_haystack (prepare_niah.py), TEMPLATE
(niah_utils.py), the gen_prefix expression of generate_samples, and postprocess_pred, string_match_all and
process_results (common_utils.py), in a namespace that supplies the three inputs lm_eval takes from elsewhere:
WORDS (this project's key list, for wonderwords'), cached_sent_tokenize (this project's sentence splitter, for
nltk's) and the essay's words (this project's haystack text, for Paul Graham's). lm_eval draws from the global
random module, seeded here with the example's own seed, so its draws are the example's. The input and
gen_prefix become the prompt through lm_eval's own path for a base model: the yaml's doc_to_text and gen_prefix
rendered by lm_eval.utils.apply_template, joined by ConfigurableTask.build_qa_turn with the yaml's
target_delimiter. The prompts must agree character for character, except where lm_eval's draws give an
example's key a second needle (two keys alike, or a distractor needle with the key): RULER's key list is large
enough for that not to matter, this project's is not, and eval/niah.py draws another key; there the test checks
that each asked key has its own needles only.
"""

import ast
import functools
import importlib.util
import random
import re
import typing
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml
from lm_eval.api.task import ConfigurableTask
from lm_eval.utils import apply_template

from data.tokenizer import get_tokenizer
from eval import niah

RULER = Path(importlib.util.find_spec("lm_eval").submodule_search_locations[0]) / "tasks" / "ruler"
# lm_eval's names for the subtasks' haystacks (RULER's noise is its repeat)
HAYSTACK = {"noise": "repeat", "needle": "needle", "essay": "essay"}
ESSAY = " ".join(f"Sentence {i} tells of rivers, hills and {i % 7} roads home." for i in range(300))


def module_parts(path: Path, names: set) -> dict:
    """The top-level assignments and functions of a module's source named in names, executed on their own."""
    tree = ast.parse(path.read_text())
    keep = [node for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name in names
            or isinstance(node, ast.Assign) and any(getattr(t, "id", None) in names for t in node.targets)]
    assert {getattr(n, "name", None) or n.targets[0].id for n in keep} == names  # lm_eval still defines them all
    namespace = {"random": random, "uuid": uuid, "np": np, "re": re, "cache": functools.cache,
                 "Literal": typing.Literal, "WORDS": niah.WORDS, "cached_sent_tokenize": niah.haystack_sentences}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def ruler():
    prepare = module_parts(RULER / "prepare_niah.py", {
        "NEEDLE", "DEPTHS", "RANDOM_SEED", "generate_random_number", "generate_random_word", "generate_random_uuid",
        "generate_random", "generate_input_output", "get_haystack"})
    template = module_parts(RULER / "niah_utils.py", {"TEMPLATE"})["TEMPLATE"]
    samples = next(n for n in ast.parse((RULER / "prepare_niah.py").read_text()).body
                   if isinstance(n, ast.FunctionDef) and n.name == "generate_samples")
    gen_prefix = next(value for node in ast.walk(samples) if isinstance(node, ast.Dict)
                      for key, value in zip(node.keys, node.values)
                      if isinstance(key, ast.Constant) and key.value == "gen_prefix")
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    task = yaml.load((RULER / "niah_single_1.yaml").read_text(), Loader=loader)
    scoring = module_parts(RULER / "common_utils.py", {
        "DEFAULT_SEQ_LENGTHS", "postprocess_pred", "string_match_all", "process_results"})
    return {**prepare, "TEMPLATE": template, "task": task, "scoring": scoring,
            "gen_prefix": compile(ast.Expression(gen_prefix), "prepare_niah.py", "eval")}


def lm_eval_prompt(ruler, kind: str, essay: list[str], size: int, seed) -> tuple[str, list[str], bool]:
    """The prompt and answers lm_eval builds for one of its niah tasks with `size` haystack units, drawing from
    the global random stream seeded with seed (restored afterwards), and whether its draws gave an example's key
    twice (two keys alike, or a distractor needle with an example's key)."""
    haystack, type_k, type_v, n_keys, n_values, n_asked = niah.SUBTASKS[kind]
    if haystack == "essay":  # lm_eval's essay haystack is words; these join to the first `size` sentences
        words = " ".join(essay[i % len(essay)] for i in range(size)).split(" ")
        stack, units = words, len(words)
    else:
        stack, units = ruler["get_haystack"](type_haystack=HAYSTACK[haystack]), size
    build = ruler["generate_input_output"]
    draw, draws = build.__globals__["generate_random"], []
    build.__globals__["generate_random"] = lambda kind: draws.append(draw(kind)) or draws[-1]
    state = random.getstate()
    random.seed(seed)
    try:
        # niah_utils.py's niah_* call generate_samples with these; it raises num_needle_k to num_needle_q
        text, answers, query = build(
            units, stack, type_haystack=HAYSTACK[haystack], num_needle_k=max(n_keys, n_asked),
            type_needle_k=type_k, num_needle_v=n_values, type_needle_v=type_v, template=ruler["TEMPLATE"],
            num_needle_q=n_asked)
    finally:
        random.setstate(state)
        build.__globals__["generate_random"] = draw
    # the draws: each key followed by its values, then a key and a value per distractor needle
    keys = draws[:n_keys * (1 + n_values):1 + n_values]
    collides = len(set(keys)) < n_keys or bool(set(keys) & set(draws[n_keys * (1 + n_values)::2]))
    prefix = eval(ruler["gen_prefix"], {"type_needle_v": type_v, "query": query, "num_needle_q": n_asked,
                                       "num_needle_v": n_values})
    doc = {"input": text, "outputs": answers, "gen_prefix": prefix}
    task = ruler["task"]
    turn = ConfigurableTask.build_qa_turn(None, q=apply_template(task["doc_to_text"], doc),
                                          gen_prefix=apply_template(task["gen_prefix"], doc),
                                          tgt_delim=task["target_delimiter"])
    return "".join(message.to_text() for message in turn), answers, collides


def is_rulers(ruler, kind: str, essay: list[str], size: int, seed, prompt: str, expected: list[str]) -> bool:
    """Asserts that (prompt, expected) is lm_eval's for the same draws, or, where lm_eval's draws asked a key
    that has more needles than its own (ruler_prompt's one departure: this key list is small enough for it to
    happen), that this module's prompt asks no such key. True when compared character for character."""
    theirs, answers, collides = lm_eval_prompt(ruler, kind, essay, size, seed)
    if not collides:
        assert prompt == theirs
        assert expected == answers
        return True
    query = re.search(r"for (.+) mentioned in the provided text\?", prompt)[1]
    for key in re.split(r", and |, ", query):
        assert prompt.count(f" for {key} is: ") == niah.SUBTASKS[kind][4]
    return False


def test_needle_template_noise_and_depths_are_lm_evals(ruler):
    assert niah.NEEDLE == ruler["NEEDLE"]
    assert niah.TEMPLATE == ruler["TEMPLATE"]
    assert niah.NOISE == ruler["get_haystack"](type_haystack="repeat")
    assert niah.NEEDLE == ruler["get_haystack"](type_haystack="needle")
    assert niah.DEPTHS == [int(d) for d in ruler["DEPTHS"]]


@pytest.mark.parametrize("kind", niah.KINDS)
def test_every_subtask_prompt_is_lm_evals_character_for_character(ruler, kind):
    """The whole prompt a model is asked (template, haystack, needles where RULER puts them, query, answer
    prefix) and the expected values: at the sizes make_example grows the haystack to (byte tokens decode to the
    exact text), at the smallest haystack, and at 300 units over several seeds."""
    tok = get_tokenizer("byte")
    essay = niah.haystack_sentences(ESSAY)
    compared = 0
    for length, index in ((1500, 0), (4000, 1)):
        e = niah.make_example(tok, essay, kind, length, None, index, seed=3, gen_tokens=64)
        seed = niah.example_seed(3, kind, length, None, index)
        compared += is_rulers(ruler, kind, essay, e["haystack_size"], seed, tok.decode(e["context"]), e["expected"])
    n_needles = niah.SUBTASKS[kind][3] * niah.SUBTASKS[kind][4]
    smallest = 0 if niah.SUBTASKS[kind][0] == "essay" else n_needles  # RULER's lines hold one needle each
    ours = niah.ruler_prompt(kind, essay, smallest, random.Random("s"))
    compared += is_rulers(ruler, kind, essay, smallest, "s", *ours)
    # 300 sentences: where RULER's int(len * (depth / 100)) and int(len * depth / 100) part (depths 41, 69, 82)
    for seed in range(12):
        ours = niah.ruler_prompt(kind, essay, 300, random.Random(seed))
        compared += is_rulers(ruler, kind, essay, 300, seed, *ours)
    assert compared >= 10, compared  # of 15


def test_where_rulers_draws_give_a_key_twice_another_is_drawn(ruler):
    """ruler_prompt's one departure, in the cases where it acts: RULER's draws for seed 51 give two of four keys
    alike, and for seed 0 a distractor needle with the example's key; this module asks a key with one needle."""
    essay = niah.haystack_sentences(ESSAY)
    for kind, size, seed in (("niah_multikey_1", 5, 51), ("niah_multiquery", 5, 51), ("niah_multikey_2", 300, 0)):
        assert lm_eval_prompt(ruler, kind, essay, size, seed)[2]
        assert not is_rulers(ruler, kind, essay, size, seed, *niah.ruler_prompt(kind, essay, size, random.Random(seed)))


def test_depth_sweep_keeps_rulers_strings_and_moves_only_the_asked_needle(ruler):
    """A depth sweep is not RULER's, but its prompt differs from RULER's only where the asked needle stands."""
    essay = niah.haystack_sentences(ESSAY)
    for kind in ("niah_single_1", "niah_multikey_1"):
        reference, answers, _ = lm_eval_prompt(ruler, kind, essay, 40, "d")
        for depth in (0.0, 0.5, 1.0):
            prompt, expected = niah.ruler_prompt(kind, essay, 40, random.Random("d"), depth)
            needle = re.search(rf"One of the special magic numbers for [a-z-]+ is: {answers[0]}\.", reference)[0]
            assert expected == answers and prompt != reference
            assert re.sub(r"\s+", " ", prompt.replace(needle, "")) == re.sub(r"\s+", " ", reference.replace(needle, ""))
            before = prompt.index(needle) / len(prompt)
            assert abs(before - depth) < 0.1


def test_score_is_lm_evals_niah_score(ruler):
    """lm_eval's niah tasks score a generation with process_results (postprocess_pred, then string_match_all)."""
    process = ruler["scoring"]["process_results"]
    length = ruler["scoring"]["DEFAULT_SEQ_LENGTHS"][0]
    cases = [(" 1234567, 7654321 and 42", ["1234567", "7654321", "0000000", "1111111"]),
             ("ABCDEF-01 \x00\t", ["abcdef-01"]), ("12345\n67", ["1234567"]), ("", ["1"]),
             (" The special magic number is 7654321.", ["7654321"])]
    for generated, expected in cases:
        ours = niah.string_match_all(generated, expected)
        assert ours == process({"max_length": length, "outputs": expected}, [generated])[str(length)]
    assert [niah.string_match_all(g, x) for g, x in cases] == [0.5, 1.0, 0.0, 0.0, 1.0]
