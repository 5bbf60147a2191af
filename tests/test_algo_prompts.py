"""The `algo` prompt source: references checked against hand-worked answers, and every drawn
stub's examples checked by running them (doctest for `>>>` lines)."""

import ast
import doctest
import random

import pytest

from dflash_robot.training import algo as A
from dflash_robot.training import data as D
from dflash_robot.training import prompts as P

TASK = {t.name: t for t in A.TASKS}
PRED = {p.slug: p for p in A.PREDS}


def run(task: str, x, k: int = 0, pred: str | None = None):
    return TASK[task].ref(x, k, PRED[pred] if pred else None)


# (task, input, k, predicate, answer worked out by hand)
HAND = [
    ("sum_{p}", [1, 2, 3, 4, 7], 0, "even", 6),
    ("count_{p}", [9, 4, 16, -4, 5], 0, "square", 3),
    ("largest_{p}", [4, 6, 8], 0, "prime", None),
    ("index_of_first_{p}", [10, 14, 21, 7], 7, "multiple_of_{k}", 1),
    ("split_{p}", [5, -1, 0, 3], 0, "positive", ([5, 3], [-1, 0])),
    ("all_{p}", [], 0, "odd", True),
    ("square_{p}", [3, 12, 10], 0, "two_digit", [3, 144, 100]),
    ("rotate_left", [1, 2, 3], 4, None, [2, 3, 1]),
    ("chunk_sums", [1, 2, 3, 4, 5], 2, None, [3, 7, 5]),
    ("second_largest", [5, 5, 3], 0, None, 3),
    ("most_common", [3, 1, 3, 1, 2], 0, None, 1),
    ("longest_increasing_run", [1, 2, 2, 3, 4, 5, 0], 0, None, 4),
    ("count_pairs_with_sum", [1, 3, 2, 2, 3], 5, None, 4),
    ("alternating_sum", [5, 3, 2], 0, None, 4),
    ("sort_by_digit_sum", [19, -2, 11, 3], 0, None, [-2, 11, 3, 19]),
    ("below_average", [1, 2, 3, 10], 0, None, [1, 2, 3]),
    ("max_subarray_sum", [-2, 1, -3, 4, -1, 2, 1, -5, 4], 0, None, 6),
    ("max_subarray_sum", [-3, -1, -2], 0, None, -1),
    ("interleave_halves", [1, 2, 3, 4, 5], 0, None, [1, 4, 2, 5, 3]),
    ("running_max", [2, 1, 5, 3], 0, None, [2, 2, 5, 5]),
    ("run_length_encode", "aaabcc", 0, None, "a3b1c2"),
    ("shift_letters", "xyz A!", 2, None, "zab A!"),
    ("is_palindrome", "Never odd or even", 0, None, True),
    ("first_unique_character", "swiss", 0, None, "w"),
    ("is_balanced", "(()))(", 0, None, False),
    ("capitalize_words", "hELLO wORLD", 0, None, "Hello World"),
    ("character_counts", "AbA!", 0, None, {"a": 2, "b": 1}),
    ("common_prefix", ["flower", "flow", "flight"], 0, None, "fl"),
    ("group_by_length", ["ab", "c", "de"], 0, None, {2: ["ab", "de"], 1: ["c"]}),
    ("remove_duplicates", ["Cat", "dog", "cat", "DOG", "sky"], 0, None, ["Cat", "dog", "sky"]),
    ("sort_by_length", ["bb", "a", "ab", "c"], 0, None, ["a", "c", "ab", "bb"]),
    ("digital_root", 493193, 0, None, 2),
    ("collatz_steps", 6, 0, None, 8),
    ("fibonacci", 10, 0, None, 55),
    ("largest_prime_factor", 13195, 0, None, 29),
    ("sum_of_multiples", 10, 3, None, 3 + 5 + 6 + 9),
    ("count_primes_below", 20, 0, None, 8),
    ("is_perfect", 28, 0, None, True),
    ("reverse_digits", 1200, 0, None, 21),
    ("count_divisors", 12, 0, None, 6),
]


@pytest.mark.parametrize("task,x,k,pred,want", HAND)
def test_references_give_hand_worked_answers(task, x, k, pred, want):
    assert run(task, x, k, pred) == want


def _check_examples(prob: A.AlgoProblem) -> int:
    """Run the stub's examples against its reference; return how many ran."""
    tree = ast.parse(prob.stub + "    pass\n")
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    assert fn.name == prob.name
    doc = ast.get_docstring(fn, clean=True)
    assert doc is not None
    globs = {prob.name: prob.reference}
    if ">>>" in doc:
        test = doctest.DocTestParser().get_doctest(doc, globs, prob.name, None, 0)
        result = doctest.DocTestRunner().run(test, out=lambda s: None)
        assert result.failed == 0, prob.stub
        return result.attempted
    ran = 0
    for line in doc.splitlines():
        lhs, sep, rhs = line.partition(" == ") if " == " in line else line.partition(" -> ")
        if line.startswith(prob.name + "(") and sep:
            assert eval(lhs, dict(globs)) == eval(rhs, {}), prob.stub  # noqa: S307 - our own generated text
            ran += 1
    return ran


def test_every_drawn_stub_is_python_and_its_examples_hold():
    rng = random.Random(0)
    tasks, stubs = set(), set()
    for _ in range(1500):
        prob = A.draw_problem(rng)
        assert _check_examples(prob) == len(prob.examples) >= 1
        tasks.add(prob.task)
        stubs.add(prob.stub)
    assert len(stubs) > 1450  # random inputs: prompts rarely repeat
    assert tasks == set(TASK)


def test_algo_is_a_static_source_in_the_humaneval_wrapper_and_not_evaluation():
    rng = random.Random(1)
    prompts = P.STATIC_SOURCES["algo"](rng, 200)
    assert "algo" in P.SOURCES
    wrapped = [p for p in prompts if p.startswith(P.HUMANEVAL_WRAPPER.split("{")[0])]
    assert 100 < len(wrapped) < 190  # three in four as a HumanEval-shaped stub
    assert D.check_not_evaluation(prompts, D.evaluation_prompts()) == prompts
    assert D.parse_sources("algo:3,math:1") == [("algo", 3), ("math", 1)]
