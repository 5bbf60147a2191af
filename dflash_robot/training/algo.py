"""The `algo` prompt source: small algorithmic problems as HumanEval-shaped stubs.

`docstring` stubs describe library functions, whose answers are mostly short wrappers around the
library. HumanEval asks for algorithmic bodies: loops over lists, strings and digits. This source
composes such problems from a catalogue of tasks (an input kind, a description, a reference
implementation) and, for list tasks, a predicate with its parameter; some tasks take a second
argument (a target, a limit, a count, a second list, a character). The examples in every
docstring are computed by running the reference, so they are right; the input values are drawn at
random, so prompts rarely repeat. Nothing here reads an evaluation set.
"""

from __future__ import annotations

import math
import random
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise, takewhile
from typing import Any

from dflash_robot.training.prompts import HUMANEVAL_WRAPPER, humaneval_stub

# ---------------------------------------------------------------- helpers for the references


def _is_prime(v: int) -> bool:
    return v >= 2 and all(v % d for d in range(2, int(v ** 0.5) + 1))


def _is_square(v: int) -> bool:
    return v >= 0 and int(v ** 0.5) ** 2 == v


def _zip(pair: tuple[list[int], list[int]]) -> zip:
    """The elements of two lists at the same positions, as far as the shorter goes."""
    return zip(pair[0], pair[1], strict=False)


def _digit_sum(v: int) -> int:
    return sum(int(c) for c in str(abs(v)))


def _rle(s: str) -> str:
    out: list[str] = []
    for c in s:
        if out and out[-1][0] == c:
            out[-1] += c
        else:
            out.append(c)
    return "".join(f"{run[0]}{len(run)}" for run in out)


def _caesar(s: str, k: int) -> str:
    return "".join(chr((ord(c) - 97 + k) % 26 + 97) if "a" <= c <= "z" else c for c in s)


def _longest_run(xs: list[int]) -> int:
    best = run = 0
    for i, v in enumerate(xs):
        run = run + 1 if i and v > xs[i - 1] else 1
        best = max(best, run)
    return best


def _max_subarray(xs: list[int]) -> int:
    best, cur = xs[0], 0
    for v in xs:
        cur = max(v, cur + v)
        best = max(best, cur)
    return best


def _balanced(s: str) -> bool:
    depth = 0
    for c in s:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _interleave(xs: list[int]) -> list[int]:
    half = (len(xs) + 1) // 2
    return [xs[i // 2 + (i % 2) * half] for i in range(len(xs))]


def _repeated(s: str) -> list[str]:
    return sorted(c for c, n in Counter(s).items() if n > 1 and c != " ")


def _common_prefix(words: list[str]) -> str:
    if not words:
        return ""
    p = words[0]
    for w in words[1:]:
        while not w.startswith(p):
            p = p[:-1]
    return p


def _duplicates(xs: list[int]) -> list[int]:
    return sorted(v for v, n in Counter(xs).items() if n > 1)


def _most_frequent_letter(s: str) -> str:
    counts = Counter(c.lower() for c in s if c.isalpha())
    return min(counts, key=lambda c: (-counts[c], c)) if counts else ""


# ---------------------------------------------------------------- the catalogue

@dataclass(frozen=True)
class Pred:
    slug: str          # used in the function name, `{k}` filled in
    text: str          # "even", "divisible by {k}"
    test: Callable[[int, int], bool]
    k: tuple[int, int] | None = None


PREDS = (
    Pred("even", "even", lambda v, k: v % 2 == 0),
    Pred("odd", "odd", lambda v, k: v % 2 != 0),
    Pred("positive", "positive", lambda v, k: v > 0),
    Pred("negative", "negative", lambda v, k: v < 0),
    Pred("multiple_of_{k}", "a multiple of {k}", lambda v, k: v % k == 0, (3, 9)),
    Pred("greater_than_{k}", "greater than {k}", lambda v, k: v > k, (0, 15)),
    Pred("less_than_{k}", "less than {k}", lambda v, k: v < k, (0, 15)),
    Pred("prime", "prime", lambda v, k: _is_prime(v)),
    Pred("square", "a perfect square", lambda v, k: _is_square(v)),
    Pred("two_digit", "a two-digit number (10 to 99 or -99 to -10)", lambda v, k: 10 <= abs(v) <= 99),
)


@dataclass(frozen=True)
class Task:
    kind: str          # ints | text | words | int
    name: str          # function name; `{p}` is the predicate's slug, `{k}` the parameter
    text: str          # what to return; `{p}` is the predicate's text
    ref: Callable[..., Any]  # (x, k, pred) -> result
    ret: str           # return annotation
    k: tuple[int, int] | None = None
    uses_pred: bool = False
    args: tuple[str, ...] = ()  # argument names of a two-argument kind (default: ARG's)


def _sel(xs: list[int], k: int, p: Pred) -> list[int]:
    return [v for v in xs if p.test(v, k)]


VOWELS = "aeiouAEIOU"

TASKS = (
    # lists of integers, with a predicate
    Task("ints", "sum_{p}", "return the sum of the elements that are {p}. Return 0 if there are none.",
         lambda xs, k, p: sum(_sel(xs, k, p)), "int", uses_pred=True),
    Task("ints", "count_{p}", "return how many elements are {p}.",
         lambda xs, k, p: len(_sel(xs, k, p)), "int", uses_pred=True),
    Task("ints", "keep_{p}", "return a list of the elements that are {p}, in their original order.",
         lambda xs, k, p: _sel(xs, k, p), "List[int]", uses_pred=True),
    Task("ints", "remove_{p}", "return the list without the elements that are {p}.",
         lambda xs, k, p: [v for v in xs if not p.test(v, k)], "List[int]", uses_pred=True),
    Task("ints", "largest_{p}", "return the largest element that is {p}, or None if there is none.",
         lambda xs, k, p: max(_sel(xs, k, p), default=None), "Optional[int]", uses_pred=True),
    Task("ints", "smallest_{p}", "return the smallest element that is {p}, or None if there is none.",
         lambda xs, k, p: min(_sel(xs, k, p), default=None), "Optional[int]", uses_pred=True),
    Task("ints", "index_of_first_{p}",
         "return the index of the first element that is {p}, or -1 if there is none.",
         lambda xs, k, p: next((i for i, v in enumerate(xs) if p.test(v, k)), -1), "int", uses_pred=True),
    Task("ints", "all_{p}", "return True if every element is {p}, and False otherwise. An empty list gives True.",
         lambda xs, k, p: all(p.test(v, k) for v in xs), "bool", uses_pred=True),
    Task("ints", "any_{p}", "return True if at least one element is {p}, and False otherwise.",
         lambda xs, k, p: any(p.test(v, k) for v in xs), "bool", uses_pred=True),
    Task("ints", "square_{p}",
         "return a new list in which every element that is {p} is squared and the others are unchanged.",
         lambda xs, k, p: [v * v if p.test(v, k) else v for v in xs], "List[int]", uses_pred=True),
    Task("ints", "split_{p}",
         "return a tuple of two lists: the elements that are {p}, then the others, each in their original order.",
         lambda xs, k, p: (_sel(xs, k, p), [v for v in xs if not p.test(v, k)]),
         "Tuple[List[int], List[int]]", uses_pred=True),
    # lists of integers
    Task("ints", "running_sum", "return the running sums: element i of the result is the sum of the first i + 1 "
         "elements.", lambda xs, k, p: [sum(xs[:i + 1]) for i in range(len(xs))], "List[int]"),
    Task("ints", "differences", "return the differences between consecutive elements (each element minus the one "
         "before it). A list with fewer than two elements gives an empty list.",
         lambda xs, k, p: [b - a for a, b in pairwise(xs)], "List[int]"),
    Task("ints", "second_largest", "return the second largest distinct value, or None if there are fewer than two "
         "distinct values.", lambda xs, k, p: sorted(set(xs))[-2] if len(set(xs)) > 1 else None, "Optional[int]"),
    Task("ints", "unique_in_order", "return the elements without duplicates, keeping the first occurrence of each "
         "in order.", lambda xs, k, p: list(dict.fromkeys(xs)), "List[int]"),
    Task("ints", "value_range", "return the largest element minus the smallest. An empty list gives 0.",
         lambda xs, k, p: max(xs) - min(xs) if xs else 0, "int"),
    Task("ints", "rotate_left", "return the list rotated left by {k} positions (the first {k} elements move to the "
         "end, wrapping around for short lists).", lambda xs, k, p: xs[k % len(xs):] + xs[:k % len(xs)] if xs else [],
         "List[int]", k=(1, 4)),
    Task("ints", "chunk_sums", "split the list into consecutive chunks of {k} elements (the last one may be "
         "shorter) and return the sum of each chunk.",
         lambda xs, k, p: [sum(xs[i:i + k]) for i in range(0, len(xs), k)], "List[int]", k=(2, 4)),
    Task("ints", "most_common", "return the value that occurs most often; on a tie return the smallest of them. "
         "An empty list gives None.",
         lambda xs, k, p: min(xs, key=lambda v: (-xs.count(v), v)) if xs else None, "Optional[int]"),
    Task("ints", "longest_increasing_run", "return the length of the longest run of consecutive elements that "
         "strictly increase. An empty list gives 0.", lambda xs, k, p: _longest_run(xs), "int"),
    Task("ints", "count_pairs_with_sum", "return the number of pairs of positions i < j whose elements add up "
         "to {k}.", lambda xs, k, p: sum(xs[i] + xs[j] == k for i in range(len(xs)) for j in range(i + 1, len(xs))),
         "int", k=(4, 20)),
    Task("ints", "alternating_sum", "return the first element minus the second plus the third minus the fourth, "
         "and so on. An empty list gives 0.", lambda xs, k, p: sum(v if i % 2 == 0 else -v for i, v in enumerate(xs)),
         "int"),
    Task("ints", "sort_by_digit_sum", "return the elements sorted by the sum of the digits of their absolute "
         "value, keeping the original order of elements with equal sums.",
         lambda xs, k, p: sorted(xs, key=_digit_sum), "List[int]"),
    Task("ints", "below_average", "return the elements that are smaller than the average of the list, in their "
         "original order.", lambda xs, k, p: [v for v in xs if v * len(xs) < sum(xs)], "List[int]"),
    Task("ints", "max_subarray_sum", "return the largest sum of a non-empty run of consecutive elements. "
         "The list is not empty.", lambda xs, k, p: _max_subarray(xs), "int"),
    Task("ints", "is_sorted", "return True if the elements are in non-decreasing order, and False otherwise.",
         lambda xs, k, p: all(a <= b for a, b in pairwise(xs)), "bool"),
    Task("ints", "running_max", "return a list whose element i is the largest of the first i + 1 elements.",
         lambda xs, k, p: [max(xs[:i + 1]) for i in range(len(xs))], "List[int]"),
    Task("ints", "count_greater_than_previous", "return how many elements are greater than the element just "
         "before them.", lambda xs, k, p: sum(b > a for a, b in pairwise(xs)), "int"),
    Task("ints", "sum_of_squares", "return the sum of the squares of the elements.",
         lambda xs, k, p: sum(v * v for v in xs), "int"),
    Task("ints", "interleave_halves", "split the list into a first half and a second half (the first half gets the "
         "extra element when the length is odd) and return their elements interleaved, starting with the first "
         "half.", lambda xs, k, p: _interleave(xs), "List[int]"),
    # strings
    Task("text", "count_vowels", "return the number of vowels (a, e, i, o, u, in either case) in the string.",
         lambda s, k, p: sum(c in VOWELS for c in s), "int"),
    Task("text", "count_uppercase", "return the number of uppercase letters in the string.",
         lambda s, k, p: sum(c.isupper() for c in s), "int"),
    Task("text", "reverse_words", "return the words of the string in reverse order, separated by single spaces.",
         lambda s, k, p: " ".join(s.split()[::-1]), "str"),
    Task("text", "capitalize_words", "return the string with the first letter of every word in uppercase and the "
         "other letters in lowercase; words are separated by single spaces.",
         lambda s, k, p: " ".join(w.capitalize() for w in s.split(" ")), "str"),
    Task("text", "is_palindrome", "return True if the string reads the same backwards when case and every "
         "character that is not a letter are ignored.",
         lambda s, k, p: [c.lower() for c in s if c.isalpha()] == [c.lower() for c in s if c.isalpha()][::-1],
         "bool"),
    Task("text", "remove_vowels", "return the string with every vowel (a, e, i, o, u, in either case) removed.",
         lambda s, k, p: "".join(c for c in s if c not in VOWELS), "str"),
    Task("text", "longest_word", "return the longest word of the string (words are separated by spaces); on a tie "
         "return the first one. An empty string gives an empty string.",
         lambda s, k, p: max(s.split(), key=len, default=""), "str"),
    Task("text", "repeated_characters", "return a sorted list of the characters that occur more than once in the "
         "string, ignoring spaces.", lambda s, k, p: _repeated(s),
         "List[str]"),
    Task("text", "run_length_encode", "return the run-length encoding of the string: each run of equal characters "
         "becomes the character followed by the length of the run.", lambda s, k, p: _rle(s), "str"),
    Task("text", "shift_letters", "return the string with every lowercase letter shifted {k} places forward in the "
         "alphabet, wrapping from z to a; other characters are unchanged.", lambda s, k, p: _caesar(s, k), "str",
         k=(1, 5)),
    Task("text", "alternate_case", "return the string with the characters at even positions in uppercase and "
         "those at odd positions in lowercase.",
         lambda s, k, p: "".join(c.upper() if i % 2 == 0 else c.lower() for i, c in enumerate(s)), "str"),
    Task("text", "first_unique_character", "return the first character that occurs exactly once in the string, "
         "or an empty string if there is none.",
         lambda s, k, p: next((c for c in s if s.count(c) == 1), ""), "str"),
    Task("text", "character_counts", "return a dictionary that maps every letter of the string, in lowercase, to "
         "the number of times it occurs, ignoring case; characters that are not letters are not counted.",
         lambda s, k, p: dict(Counter(c.lower() for c in s if c.isalpha())), "Dict[str, int]"),
    Task("text", "is_balanced", "return True if the parentheses in the string are balanced: every '(' has a "
         "matching ')' after it, and no ')' comes before its '('.", lambda s, k, p: _balanced(s), "bool"),
    Task("text", "count_words_longer_than", "return how many words of the string (separated by spaces) have more "
         "than {k} characters.", lambda s, k, p: sum(len(w) > k for w in s.split()), "int", k=(2, 5)),
    # lists of strings
    Task("words", "longer_than", "return the strings that have more than {k} characters, in their original order.",
         lambda ws, k, p: [w for w in ws if len(w) > k], "List[str]", k=(2, 5)),
    Task("words", "longest_string", "return the longest string; on a tie return the first one. An empty list gives "
         "None.", lambda ws, k, p: max(ws, key=len) if ws else None, "Optional[str]"),
    Task("words", "sort_by_length", "return the strings sorted by length, and strings of equal length in "
         "alphabetical order.", lambda ws, k, p: sorted(ws, key=lambda w: (len(w), w)), "List[str]"),
    Task("words", "count_palindromes", "return how many of the strings read exactly the same backwards, case "
         "included.",
         lambda ws, k, p: sum(w == w[::-1] for w in ws), "int"),
    Task("words", "group_by_length", "return a dictionary that maps each length to the list of strings of that "
         "length, in their original order.",
         lambda ws, k, p: {n: [w for w in ws if len(w) == n] for n in dict.fromkeys(len(w) for w in ws)},
         "Dict[int, List[str]]"),
    Task("words", "total_length", "return the total number of characters in all the strings.",
         lambda ws, k, p: sum(len(w) for w in ws), "int"),
    Task("words", "common_prefix", "return the longest prefix shared by all the strings. An empty list gives an "
         "empty string.", lambda ws, k, p: _common_prefix(ws), "str"),
    Task("words", "first_letters", "return a string made of the first letter of every non-empty string.",
         lambda ws, k, p: "".join(w[0] for w in ws if w), "str"),
    Task("words", "remove_duplicates", "return the strings without duplicates, ignoring case, keeping the first "
         "occurrence of each.",
         lambda ws, k, p: [w for i, w in enumerate(ws) if w.lower() not in {v.lower() for v in ws[:i]}],
         "List[str]"),
    # integers
    Task("int", "digit_sum", "return the sum of the digits of n.", lambda n, k, p: _digit_sum(n), "int"),
    Task("int", "count_divisors", "return the number of positive divisors of n (n is positive).",
         lambda n, k, p: sum(n % d == 0 for d in range(1, n + 1)), "int"),
    Task("int", "is_prime", "return True if n is a prime number, and False otherwise.",
         lambda n, k, p: _is_prime(n), "bool"),
    Task("int", "fibonacci", "return the n-th Fibonacci number, where fibonacci(0) is 0 and fibonacci(1) is 1.",
         lambda n, k, p: _fib(n), "int"),
    Task("int", "collatz_steps", "return how many steps the Collatz process takes to reach 1 from n: halve an even "
         "number, and replace an odd number x with 3 * x + 1.", lambda n, k, p: _collatz(n), "int"),
    Task("int", "to_binary", "return the binary representation of n as a string of 0s and 1s, without a prefix.",
         lambda n, k, p: format(n, "b"), "str"),
    Task("int", "reverse_digits", "return the number whose digits are those of n in reverse order.",
         lambda n, k, p: int(str(n)[::-1]), "int"),
    Task("int", "digital_root", "repeatedly replace n with the sum of its digits until a single digit is left, "
         "and return that digit.", lambda n, k, p: n if n < 10 else 1 + (n - 1) % 9, "int"),
    Task("int", "sum_of_multiples", "return the sum of all positive numbers below n that are multiples of {k} or "
         "of 5.", lambda n, k, p: sum(v for v in range(1, n) if v % k == 0 or v % 5 == 0), "int", k=(2, 4)),
    Task("int", "count_primes_below", "return how many prime numbers are smaller than n.",
         lambda n, k, p: sum(_is_prime(v) for v in range(n)), "int"),
    Task("int", "count_set_bits", "return the number of 1 bits in the binary representation of n.",
         lambda n, k, p: bin(n).count("1"), "int"),
    Task("int", "is_power_of_two", "return True if n is a power of two (1, 2, 4, 8, ...), and False otherwise.",
         lambda n, k, p: n > 0 and n & (n - 1) == 0, "bool"),
    Task("int", "largest_prime_factor", "return the largest prime factor of n (n is at least 2).",
         lambda n, k, p: max(d for d in range(2, n + 1) if n % d == 0 and _is_prime(d)), "int"),
    Task("int", "is_perfect", "return True if n equals the sum of its positive divisors other than itself.",
         lambda n, k, p: n == sum(d for d in range(1, n) if n % d == 0), "bool"),
    # added in session 45: stages 38-39 showed more drawn instances of the 68 tasks above no longer move
    # HumanEval, so the catalogue itself grows. None of these asks for the function of a HumanEval problem
    # (checked by hand: `median`, `swap_case`, `triangular_number`, `to_roman` and `gcd_with` were written
    # and left out as HumanEval/47, 27, 60, 156 and 13)
    Task("ints", "last_{p}", "return the last element that is {p}, or None if there is none.",
         lambda xs, k, p: next((v for v in reversed(xs) if p.test(v, k)), None), "Optional[int]", uses_pred=True),
    Task("ints", "move_{p}_to_end", "return the list with the elements that are {p} moved to the end; both groups "
         "keep their original order.", lambda xs, k, p: [v for v in xs if not p.test(v, k)] + _sel(xs, k, p),
         "List[int]", uses_pred=True),
    Task("ints", "product", "return the product of the elements. An empty list gives 1.",
         lambda xs, k, p: math.prod(xs), "int"),
    Task("ints", "pairwise_sums", "return the sums of neighbouring elements: element i of the result is element i "
         "plus element i + 1. A list with fewer than two elements gives an empty list.",
         lambda xs, k, p: [a + b for a, b in pairwise(xs)], "List[int]"),
    Task("ints", "count_local_maxima", "return how many elements, other than the first and the last, are greater "
         "than both of their neighbours.",
         lambda xs, k, p: sum(xs[i - 1] < xs[i] > xs[i + 1] for i in range(1, len(xs) - 1)), "int"),
    Task("ints", "sum_at_even_indices", "return the sum of the elements at even positions (0, 2, 4, ...).",
         lambda xs, k, p: sum(xs[::2]), "int"),
    Task("ints", "max_difference", "return the largest value of a later element minus an earlier element. A list "
         "with fewer than two elements gives 0.",
         lambda xs, k, p: max((xs[j] - xs[i] for i in range(len(xs)) for j in range(i + 1, len(xs))), default=0),
         "int"),
    Task("ints", "nearest_to_zero", "return the element closest to zero; on a tie return the positive one. An "
         "empty list gives None.", lambda xs, k, p: min(xs, key=lambda v: (abs(v), -v)) if xs else None,
         "Optional[int]"),
    Task("ints", "count_distinct", "return how many different values the list holds.",
         lambda xs, k, p: len(set(xs)), "int"),
    Task("ints", "duplicates", "return a sorted list of the values that occur more than once.",
         lambda xs, k, p: _duplicates(xs), "List[int]"),
    Task("ints", "ranks", "replace every element with its rank among the distinct values of the list: the "
         "smallest value has rank 1, the next larger one rank 2, and so on.",
         lambda xs, k, p: [sorted(set(xs)).index(v) + 1 for v in xs], "List[int]"),
    Task("ints", "count_pairs_with_difference", "return the number of pairs of positions i < j whose elements "
         "differ by exactly {k}.",
         lambda xs, k, p: sum(abs(xs[i] - xs[j]) == k for i in range(len(xs)) for j in range(i + 1, len(xs))),
         "int", k=(1, 6)),
    Task("ints", "clamp", "return the list with every element below 0 replaced by 0 and every element above {k} "
         "replaced by {k}.", lambda xs, k, p: [min(max(v, 0), k) for v in xs], "List[int]", k=(5, 20)),
    Task("text", "count_words", "return the number of words in the string; words are separated by spaces.",
         lambda s, k, p: len(s.split()), "int"),
    Task("text", "reverse_each_word", "return the string with the characters of every word reversed, punctuation "
         "included, and the words kept in their order; words are separated by single spaces.",
         lambda s, k, p: " ".join(w[::-1] for w in s.split(" ")), "str"),
    Task("text", "most_frequent_letter", "return the letter that occurs most often, in lowercase, ignoring case; "
         "on a tie return the one that comes first in the alphabet. A string without letters gives an empty "
         "string.", lambda s, k, p: _most_frequent_letter(s), "str"),
    Task("text", "count_consonants", "return the number of letters in the string that are not vowels (a, e, i, o, "
         "u, in either case).", lambda s, k, p: sum(c.isalpha() and c not in VOWELS for c in s), "int"),
    Task("text", "acronym", "return the first letters of the words of the string, in uppercase, as one string.",
         lambda s, k, p: "".join(w[0].upper() for w in s.split()), "str"),
    Task("text", "unique_characters", "return the characters of the string without repeats, each at its first "
         "occurrence, as one string.", lambda s, k, p: "".join(dict.fromkeys(s)), "str"),
    Task("text", "word_lengths", "return a list of the lengths of the words of the string; words are separated by "
         "spaces.", lambda s, k, p: [len(w) for w in s.split()], "List[int]"),
    Task("words", "palindromes", "return the strings that read exactly the same backwards, case included, in their "
         "original order.",
         lambda ws, k, p: [w for w in ws if w == w[::-1]], "List[str]"),
    Task("words", "count_starting_with_vowel", "return how many of the strings start with a vowel (a, e, i, o, u, "
         "in either case).", lambda ws, k, p: sum(bool(w) and w[0] in VOWELS for w in ws), "int"),
    Task("words", "reverse_strings", "return a list of the strings, each reversed, in their original order.",
         lambda ws, k, p: [w[::-1] for w in ws], "List[str]"),
    Task("words", "sort_ignoring_case", "return the strings sorted alphabetically, ignoring case; strings equal "
         "apart from case keep their original order.", lambda ws, k, p: sorted(ws, key=str.lower), "List[str]"),
    Task("words", "join_shorter_than", "return the strings with fewer than {k} characters, joined by a single "
         "dash.", lambda ws, k, p: "-".join(w for w in ws if len(w) < k), "str", k=(3, 6)),
    Task("int", "factorial", "return n factorial, the product of the numbers from 1 to n; 0 factorial is 1.",
         lambda n, k, p: math.factorial(n), "int"),
    Task("int", "count_digits", "return the number of digits of n (n is not negative).",
         lambda n, k, p: len(str(n)), "int"),
    Task("int", "is_palindrome_number", "return True if the digits of n read the same backwards, and False "
         "otherwise.", lambda n, k, p: str(n) == str(n)[::-1], "bool"),
    Task("int", "next_prime", "return the smallest prime number that is greater than n.",
         lambda n, k, p: next(v for v in range(n + 1, 2 * n + 3) if _is_prime(v)), "int"),
    Task("int", "sum_of_divisors", "return the sum of the positive divisors of n, n included (n is positive).",
         lambda n, k, p: sum(d for d in range(1, n + 1) if n % d == 0), "int"),
    Task("int", "is_leap_year", "return True if the year n is a leap year: divisible by 4, except years divisible "
         "by 100 that are not divisible by 400.", lambda n, k, p: n % 4 == 0 and (n % 100 != 0 or n % 400 == 0),
         "bool"),
    Task("int", "sum_of_digit_squares", "return the sum of the squares of the digits of n.",
         lambda n, k, p: sum(int(c) ** 2 for c in str(abs(n))), "int"),
    # added in session 46: functions of two arguments, as most HumanEval problems are (the tasks above
    # take one); the input `a` is the pair of arguments. Checked by hand against HumanEval's functions:
    # `count_char` (a case of HumanEval/18's `how_many_times`) was written and left out
    Task("ints_int", "count_occurrences", "return how many times `target` occurs in the list.",
         lambda a, k, p: a[0].count(a[1]), "int"),
    Task("ints_int", "positions_of", "return the indices at which `target` occurs in the list, in increasing "
         "order.", lambda a, k, p: [i for i, v in enumerate(a[0]) if v == a[1]], "List[int]"),
    Task("ints_int", "remove_all", "return the list with every occurrence of `target` removed.",
         lambda a, k, p: [v for v in a[0] if v != a[1]], "List[int]"),
    Task("ints_int", "first_at_least", "return the index of the first element that is at least `limit`, or -1 if "
         "there is none.", lambda a, k, p: next((i for i, v in enumerate(a[0]) if v >= a[1]), -1), "int",
         args=("numbers", "limit")),
    Task("ints_int", "take_while_below", "return the elements from the start of the list up to, and not including, "
         "the first element that is not less than `limit`.",
         lambda a, k, p: list(takewhile(lambda v: v < a[1], a[0])), "List[int]", args=("numbers", "limit")),
    Task("ints_int", "window_sums", "return the sums of every run of `size` consecutive elements, from left to "
         "right. A list shorter than `size` gives an empty list.",
         lambda a, k, p: [sum(a[0][i:i + a[1]]) for i in range(len(a[0]) - a[1] + 1)], "List[int]",
         args=("numbers", "size")),
    Task("ints_int", "every_nth", "return the elements at positions 0, `step`, 2 * `step`, and so on.",
         lambda a, k, p: a[0][::a[1]], "List[int]", args=("numbers", "step")),
    Task("ints_int", "sum_of_last", "return the sum of the last `count` elements, or of all of them if the list "
         "is shorter.", lambda a, k, p: sum(a[0][max(len(a[0]) - a[1], 0):]), "int", args=("numbers", "count")),
    Task("ints_ints", "elementwise_sum", "return the sums of the elements at the same position in both lists, as "
         "far as the shorter list goes.", lambda a, k, p: [x + y for x, y in _zip(a)], "List[int]"),
    Task("ints_ints", "dot_product", "return the sum of the products of the elements at the same position in both "
         "lists, as far as the shorter list goes.", lambda a, k, p: sum(x * y for x, y in _zip(a)), "int"),
    Task("ints_ints", "only_in_first", "return the elements of `first` that do not occur in `second`, in their "
         "original order.", lambda a, k, p: [v for v in a[0] if v not in a[1]], "List[int]"),
    Task("ints_ints", "merge_sorted", "return the elements of both lists, each of which is sorted in "
         "non-decreasing order, as one list sorted in non-decreasing order.",
         lambda a, k, p: sorted(a[0] + a[1]), "List[int]"),
    Task("ints_ints", "count_equal_positions", "return how many positions hold the same value in both lists, as "
         "far as the shorter list goes.", lambda a, k, p: sum(x == y for x, y in _zip(a)), "int"),
    Task("text_char", "char_positions", "return the indices at which `char` occurs in `text`, in increasing "
         "order; case matters.", lambda a, k, p: [i for i, c in enumerate(a[0]) if c == a[1]], "List[int]"),
    Task("text_char", "remove_char", "return `text` with every occurrence of `char` removed; case matters.",
         lambda a, k, p: a[0].replace(a[1], ""), "str"),
    Task("text_char", "split_on", "return the pieces that `text` falls into when it is cut at every occurrence of "
         "`char`, in order; empty pieces are kept.", lambda a, k, p: a[0].split(a[1]), "List[str]"),
    Task("text_char", "words_starting_with", "return the words of `text` (separated by spaces) that start with "
         "`char`, ignoring case, in their order.",
         lambda a, k, p: [w for w in a[0].split() if w[0].lower() == a[1].lower()], "List[str]"),
    Task("text_int", "first_words", "return the first `count` words of `text` (words are separated by spaces), "
         "joined by single spaces.", lambda a, k, p: " ".join(a[0].split()[:a[1]]), "str"),
    Task("text_int", "repeat_characters", "return `text` with every character repeated, each one written `times` "
         "times in a row.", lambda a, k, p: "".join(c * a[1] for c in a[0]), "str", args=("text", "times")),
)

ARG = {"ints": (("numbers", "List[int]"),), "text": (("text", "str"),), "words": (("strings", "List[str]"),),
       "int": (("n", "int"),), "ints_int": (("numbers", "List[int]"), ("target", "int")),
       "ints_ints": (("first", "List[int]"), ("second", "List[int]")),
       "text_char": (("text", "str"), ("char", "str")), "text_int": (("text", "str"), ("count", "int"))}
# (parameter name, annotation) of each kind; a task's `args` renames them
INTRO = {
    "ints": ["Given a list of integers, ", "You are given a list of integers `numbers`. ",
             "Take a list of integers and ", "For the list of integers `numbers`, "],
    "text": ["Given a string, ", "You are given a string `text`. ", "Take a string and ", "For the string `text`, "],
    "words": ["Given a list of strings, ", "You are given a list of strings `strings`. ",
              "Take a list of strings and ", "For the list of strings `strings`, "],
    "int": ["Given an integer n, ", "You are given an integer `n`. ", "Take an integer n and ", "For the number n, "],
    "ints_int": ["Given a list of integers `numbers` and an integer `{1}`, ",
                 "You are given a list of integers `numbers` and an integer `{1}`. ",
                 "Take a list of integers `numbers` and an integer `{1}`, and ",
                 "For the list `numbers` and the integer `{1}`, "],
    "ints_ints": ["Given two lists of integers, `first` and `second`, ",
                  "You are given two lists of integers `first` and `second`. ",
                  "Take two lists of integers `first` and `second`, and ",
                  "For the lists of integers `first` and `second`, "],
    "text_char": ["Given a string `text` and a single character `char`, ",
                  "You are given a string `text` and a character `char`. ",
                  "Take a string `text` and a character `char`, and ",
                  "For the string `text` and the character `char`, "],
    "text_int": ["Given a string `text` and an integer `{1}`, ", "You are given a string `text` and an integer `{1}`. ",
                 "Take a string `text` and an integer `{1}`, and ", "For the string `text` and the integer `{1}`, "],
}
WORDS = ("apple", "level", "stone", "river", "noon", "Kayak", "tree", "sun", "banana", "code", "radar", "data",
         "loop", "moon", "Python", "list", "wow", "green", "a", "bb", "cat", "dog", "Anna", "sky", "bird", "ocean",
         "plan", "test", "rotor", "night", "day", "star", "lamp", "map", "Hello", "world", "apply", "apt")


INT_RANGE = {"fibonacci": (0, 25), "count_divisors": (1, 200), "collatz_steps": (1, 60),
             "count_primes_below": (0, 100), "largest_prime_factor": (2, 300), "is_perfect": (0, 500),
             "factorial": (0, 15), "next_prime": (0, 500), "sum_of_divisors": (1, 500),
             "is_leap_year": (1800, 2400)}
NON_EMPTY = {"max_subarray_sum"}  # list tasks whose text promises a non-empty list
REPEATS = {"duplicates", "count_distinct", "ranks"}  # list tasks about repeated values


def _sentence(rng: random.Random, lo: int = 1) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, 5))]
    return " ".join(w.upper() if rng.random() < 0.15 else w for w in words) + rng.choice(["", "", "!", "."])


def _params(task: Task) -> tuple[tuple[str, str], ...]:
    """(name, annotation) of each parameter: the kind's, renamed by the task's `args`."""
    kind = ARG[task.kind]
    return tuple(zip(task.args, (ann for _, ann in kind), strict=True)) if task.args else kind


def _pair(task: Task, rng: random.Random) -> tuple[Any, Any]:
    """The arguments of a two-argument task, drawn so that answers are seldom trivial: a target that
    occurs in the list, a limit that ends a non-empty prefix of it, a character of the text (for
    `words_starting_with` the first letter of a word), a count below the number of words, lists that
    agree at some positions."""
    second = _params(task)[1][0]
    if task.kind == "ints_ints":
        xs = [rng.randint(-3, 9) for _ in range(rng.randint(0, 7))]
        ys = [rng.randint(-3, 9) for _ in range(rng.randint(0, 7))]
        if task.name == "merge_sorted":
            return sorted(xs), sorted(ys)
        return xs, [x if rng.random() < 0.4 else y for x, y in zip(xs, ys, strict=False)] + ys[len(xs):]
    if task.kind == "ints_int":
        xs = [rng.randint(-3, 12) for _ in range(rng.randint(0, 8))]  # narrow, so that targets repeat
        if second == "target":
            return xs, rng.choice(xs) if xs and rng.random() < 0.7 else rng.randint(-3, 12)
        if second == "limit":  # a record (larger than all before it) stops both limit tasks after a prefix
            records = [v for i, v in enumerate(xs) if i and v > max(xs[:i])]
            return xs, rng.choice(records) if records and rng.random() < 0.8 else rng.randint(-3, 12)
        return xs, rng.randint(1, max(len(xs), 1)) if rng.random() < 0.8 else rng.randint(1, 5)
    text = _sentence(rng, 0 if task.kind == "text_char" else 1)
    if task.kind == "text_char":
        if task.name == "words_starting_with":
            pool = [w[0] for w in text.split()]
        else:
            pool = [c for c in text if c.isalpha()] + ([" ", " "] if task.name == "split_on" else [])
        return text, rng.choice(pool) if pool and rng.random() < 0.8 else rng.choice("aeostnAX")
    if second == "times":
        return text, rng.randint(2, 3)
    words = len(text.split())
    return text, rng.randint(1, max(words - 1, 1)) if rng.random() < 0.8 else rng.randint(1, 6)


def _example(task: Task, rng: random.Random) -> Any:
    if len(ARG[task.kind]) == 2:
        return _pair(task, rng)
    if task.kind == "ints":
        lo = 1 if task.name in NON_EMPTY else 0
        hi = 9 if task.name in REPEATS else 40  # a narrow range, so that values repeat
        return [rng.randint(-12 if hi == 40 else -3, hi) for _ in range(rng.randint(lo, 8))]
    if task.kind == "words":
        return [rng.choice(WORDS) for _ in range(rng.randint(0, 6))]
    if task.kind == "int":
        if task.name == "is_perfect" and rng.random() < 0.3:
            return rng.choice([6, 28, 496])
        if task.name == "is_palindrome_number" and rng.random() < 0.4:  # else almost always False
            half = str(rng.randint(1, 99))
            return int(half + half[::-1][rng.randint(0, 1):])
        return rng.randint(*INT_RANGE.get(task.name, (0, 5000)))
    if task.name == "is_balanced":
        return "".join(rng.choice("(()) ab") for _ in range(rng.randint(0, 10)))
    if task.name == "run_length_encode":
        return "".join(rng.choice("abcxyz") * rng.randint(1, 4) for _ in range(rng.randint(0, 5)))
    return _sentence(rng, 0 if task.name == "longest_word" else 1)


@dataclass(frozen=True)
class AlgoProblem:
    """One drawn problem: the stub a user sees, and the parts a test checks it against."""
    task: str
    name: str
    stub: str
    reference: Callable[..., Any]  # called as the stub's function is: one argument per parameter
    examples: tuple[tuple[Any, Any], ...]  # (input, answer); a two-argument task's input is a pair


def draw_problem(rng: random.Random) -> AlgoProblem:
    task = rng.choice(TASKS)
    pred = rng.choice(PREDS) if task.uses_pred else None
    k = rng.randint(*(task.k or (pred.k if pred and pred.k else (0, 0))))
    slug = pred.slug.format(k=k) if pred else ""
    name = task.name.format(p=slug, k=k)
    text = task.text.format(p=pred.text.format(k=k) if pred else "", k=k)

    params = _params(task)

    def reference(*x: Any) -> Any:
        return task.ref(x if len(params) > 1 else x[0], k, pred)

    examples: list[tuple[Any, Any]] = []
    want = rng.randint(2, 3)
    for _ in range(20):  # distinct inputs; tasks with few possible inputs may end with fewer
        if len(examples) == want:
            break
        x = _example(task, rng)
        if all(x != e for e, _ in examples):
            examples.append((x, task.ref(x, k, pred)))
    typed = rng.random() < 0.6
    if typed:
        sig = "(" + ", ".join(f"{n}: {ann}" for n, ann in params) + f") -> {task.ret}"
    else:
        sig = "(" + ", ".join(n for n, _ in params) + ")"
    style = rng.randrange(3)
    lines = []
    for x, y in examples:
        call = f"{name}({', '.join(map(repr, x)) if len(params) > 1 else repr(x)})"
        if style == 0:  # doctest: None prints nothing, so it is shown through print()
            lines += [f">>> print({call})", str(y)] if y is None else [f">>> {call}", repr(y)]
        elif style == 1:
            lines.append(f"{call} == {y!r}")
        else:
            lines.append(f"{call} -> {y!r}")
    head = {0: "", 1: "For example:\n", 2: "Examples:\n"}[style]
    intro = rng.choice(INTRO[task.kind]).format(*(n for n, _ in params))
    if intro.endswith(". "):  # a description that starts a sentence
        text = text[:1].upper() + text[1:]
    doc = textwrap.fill(intro + text, 96) + "\n\n" + head + "\n".join(lines)
    anns = "".join(ann for _, ann in params)
    typing = sorted(t for t in ("List", "Optional", "Tuple", "Dict") if typed and t in anns + task.ret)
    header = f"from typing import {', '.join(typing)}\n\n\n" if typing else ""
    stub = header + humaneval_stub(name, sig, doc)
    return AlgoProblem(task.name, name, stub, reference, tuple(examples))


def algo_prompts(rng: random.Random, n: int) -> list[str]:
    """Three in four as a stub in z-lab's HumanEval wrapper, one in four as a plain request."""
    out = []
    for _ in range(n):
        prob = draw_problem(rng)
        if rng.random() < 0.75:
            out.append(HUMANEVAL_WRAPPER.format(stub=prob.stub))
        else:
            verb = rng.choice(["Write a Python function", "Implement a Python function", "Complete this function"])
            out.append(f"{verb} so that it passes the examples in its docstring.\n\n```python\n{prob.stub}```")
    return out
