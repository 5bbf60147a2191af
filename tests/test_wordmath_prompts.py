"""The `wordmath` prompt source: every drawn problem is solved again from its words alone, by a
small reader written here (numbers and phrases, not the generator's events), and the answers must
agree; the reader checks that every step is whole and positive, and is itself checked on problems
worked by hand. The reader knows the generator's phrasings (a new phrasing needs a reader rule: an
unknown sentence is read as a gain, and the answers then disagree)."""

import random
import re
from datetime import datetime, timedelta
from fractions import Fraction
from itertools import pairwise

import pytest

from dflash_robot.training import data as D
from dflash_robot.training import prompts as P
from dflash_robot.training import wordmath as W

WORDS = {"half": (1, 2), "a third": (1, 3), "a quarter": (1, 4), "a fifth": (1, 5), "two thirds": (2, 3),
         "three quarters": (3, 4), "two fifths": (2, 5)}
FRAC = "|".join(WORDS)
LEGS = {"cows": 4, "chickens": 2, "sheep": 4, "goats": 4, "ducks": 2, "pigs": 4,  # and wheels
        "cars": 4, "motorcycles": 2, "bicycles": 2, "tricycles": 3, "vans": 4}


def sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.?])\s+", text) if s]


def clock_minutes(t: str) -> int:
    h, m, half = re.fullmatch(r"(\d+):(\d\d) (am|pm)", t).groups()
    return (int(h) % 12 + (12 if half == "pm" else 0)) * 60 + int(m)


def whole(x: Fraction) -> int:
    assert x.denominator == 1 and x > 0, x
    return int(x)


def read_chain(text: str) -> int | str:
    """Items and money problems: a start, then one change per sentence, then the question."""
    *body, question = sentences(text)
    if re.search(r"wants to|puts all|sells every", body[-1]):  # the question's first sentence
        question = body.pop() + " " + question
    x = Fraction(re.search(r"\$?(\d+)", body[0]).group(1))
    for s in body[1:]:
        nums = [int(v) for v in re.findall(r"\d+", s)]
        if m := re.search(rf"\b({FRAC}) of the", s):
            p, q = WORDS[m.group(1)]
            x -= whole(x * p / q)
        elif "%" in s:
            x -= whole(x * nums[0] / 100)
        elif "twice as many" in s:
            x *= 2
        elif "three times as many" in s:
            x *= 3
        elif "dozen" in s:
            x += 12 * nums[0]
        elif re.search(r"packs of|boxes of|hours .* an hour|a week|every week", s):
            x += nums[0] * nums[1]
        elif re.search(r"\beach\b|apiece", s):  # m goods at $p each
            x -= nums[0] * nums[1]
        elif re.search(r"\b(loses|uses|spends|pays)\b|gives \$?\d+ [a-z ]+ to ", s):  # "gives 5 x to" a friend
            x -= nums[0]
        else:  # buys / finds / gets / earns / a friend gives
            x += nums[0]
        whole(x)
    nums = [int(v) for v in re.findall(r"\d+", question)]
    if "bags of" in question:
        return whole(x / nums[0])
    if "sells every" in question:
        return whole(x * nums[0])
    if "wants to" in question:
        return whole(nums[0] - x)
    spending = r"spends (\$|\d+%|[a-z ]+ of the)|pays|buys \d+ \D+ \$|gives (\$|\d|[a-z ]+ of the)|donates"
    spent = re.search(spending, " ".join(body))
    assert "How much money" not in question or ("left" in question) == bool(spent), text
    return whole(x)


def read_totals(text: str) -> int:
    parts = sentences(text)
    counts: dict[str, int] = {}
    first = re.fullmatch(r"A [a-z ]+? has (\d+) ([a-z ]+)\.", parts[0])
    counts[first.group(2)] = int(first.group(1))
    prices: dict[str, int] = {}
    for s in parts[1:-1]:
        if m := re.fullmatch(r"It has (twice|three times|half) as many ([a-z ]+) as ([a-z ]+)\.", s):
            a = counts[m.group(3)]
            counts[m.group(2)] = whole({"twice": 2 * a, "three times": 3 * a, "half": Fraction(a, 2)}[m.group(1)])
        elif m := re.fullmatch(r"It has (\d+) (more|fewer) ([a-z ]+) than ([a-z ]+)\.", s):
            k, a = int(m.group(1)), counts[m.group(4)]
            counts[m.group(3)] = whole(Fraction(a + k if m.group(2) == "more" else a - k))
        else:  # "Roses sell for $2 each, tulips for $3 and daisies for $1."
            flat = s.lower().replace(",", "").replace(" and", "")
            for name, p in re.findall(r"([a-z ]+?) (?:sell )?for \$(\d+)", flat):
                prices[name.strip().removeprefix("each ")] = int(p)
    q = parts[-1]
    if "legs" in q or "wheels" in q:
        return sum(c * LEGS[k] for k, c in counts.items())
    if "money" in q:
        assert set(prices) == set(counts), (prices, counts)
        return sum(c * prices[k] for k, c in counts.items())
    return sum(counts.values())


def read_rate(text: str) -> int:
    nums = [int(v) for v in re.findall(r"\d+", text)]
    if "pages an hour" in text:
        read = nums[0] * (nums[1] + nums[2] + nums[3])
        return nums[4] - read if "left" in text else read
    if "every minute" in text:  # per minute, hours a day, days
        return nums[0] * 60 * nums[1] * nums[2]
    if "per minute" in text:  # liters per minute, capacity
        return nums[1] // nums[0] // 60
    return nums[0] * nums[1] + nums[2] * nums[3]


def read_discount(text: str) -> int:
    price, pct, k = (int(v) for v in re.findall(r"\d+", text)[:3])
    coupon = int(m.group(1)) if (m := re.search(r"takes \$(\d+) off", text)) else 0
    paid = whole(Fraction(k * price * (100 - pct), 100) - coupon)
    return paid if "How much does" in text else k * price - paid


def read_clock(text: str) -> int | str:
    start = clock_minutes(re.search(r"begins at (\d+:\d\d [ap]m)", text).group(1))
    total = 0
    for h, m in re.findall(r"spends (?:(\d+) hours?)?(?: and )?(?:(\d+) minutes)?", text):
        total += 60 * int(h or 0) + int(m or 0)
    if b := re.search(r"(\d+)-minute break", text):
        total += int(b.group(1))
    if "what time" not in text:
        return total
    end = datetime(2000, 1, 1) + timedelta(minutes=start + total)
    return f"{int(end.strftime('%I'))}:{end.strftime('%M')} {end.strftime('%p').lower()}"


READERS = {"items": read_chain, "money": read_chain, "totals": read_totals, "rate": read_rate,
           "discount": read_discount, "clock": read_clock}


def test_every_drawn_problem_is_solved_again_from_its_words():
    rng = random.Random(7)
    frames = set()
    for _ in range(3000):
        prob = W.draw_problem(rng)
        frames.add(prob.frame)
        assert "{" not in prob.text and "}" not in prob.text, prob.text
        assert READERS[prob.frame](prob.text) == prob.answer, prob.text
        if isinstance(prob.answer, int):
            assert prob.answer >= 0, prob.text
        assert not BAD.search(prob.text), (BAD.search(prob.text), prob.text)
        said = sentences(prob.text)
        assert all(a != b for a, b in pairwise(said)), prob.text
    assert frames == set(READERS)


# wordings a review found in the first version: "1 hours", "buys 1 jackets", "a $8", "as winning"
BAD = re.compile(r"\b1 (?!hour\b)[a-z]+s\b|\b1 dozen|\ban? \$\d|\bas (winning|helping)")


# worked by hand from the words
HAND = [
    ("items", "Ava has 12 marbles. Ava gives a third of the marbles to Ben. Ava buys 2 dozen marbles. "
              "How many marbles does Ava have now?", 32),
    ("money", "Ava has $100. Ava earns $5 a week for 4 weeks. Ava buys 4 posters for $5 each. Ava spends 25% of "
              "the money on a book. How much money does Ava have left?", 75),
    ("money", "Ava has $10. For 3 weeks, Ava gets $4 of pocket money every week. How much money does Ava have "
              "now?", 22),
    ("totals", "A farm has 10 cows. It has 4 more chickens than cows. How many legs do all the animals have "
               "together?", 68),
    ("totals", "A bakery has 6 muffins. It has half as many pies as muffins. Muffins sell for $2 each, pies for $5. "
               "If the bakery sells all of them, how much money does it make?", 27),
    ("clock", "Ava begins at 11:50 am and spends 1 hour and 5 minutes reading, then spends 20 minutes painting. "
              "After the first activity, Ava takes one 5-minute break. At what time does Ava finish?", "1:20 pm"),
    ("discount", "A store sells lamps for $40 each. This week everything is 15% off. Ava buys 2 lamps. Ava also "
                 "uses a coupon that takes $8 off the total. How much does Ava pay?", 60),
]


@pytest.mark.parametrize("frame,text,answer", HAND)
def test_the_reader_on_hand_worked_problems(frame, text, answer):
    assert READERS[frame](text) == answer


def test_clock_and_durations():
    assert W.clock(0) == "12:00 am" and W.clock(12 * 60 + 5) == "12:05 pm" and W.clock(23 * 60 + 59) == "11:59 pm"
    assert W._duration(45) == "45 minutes" and W._duration(60) == "1 hour"
    assert W._duration(135) == "2 hours and 15 minutes"


def test_events_keep_whole_numbers():
    """The conditions are what keep answers whole: a fraction only of a multiple of its denominator."""
    part = next(e for e in W.ITEM_EVENTS if e.name == "part")
    v = {"frac": "two fifths", "p": 2, "q": 5, "purpose": "a craft"}
    assert not part.ok(12, v) and part.ok(15, v) and part.apply(15, v) == 9
    pct = next(e for e in W.MONEY_EVENTS if e.name == "percent")
    assert not pct.ok(30, {"pct": 25}) and pct.apply(40, {"pct": 25}) == 30


def test_source_is_registered_varied_and_not_evaluation():
    rng = random.Random(3)
    assert "wordmath" in P.SOURCES
    prompts = P.STATIC_SOURCES["wordmath"](rng, 400)
    assert all(p.endswith(P.GSM8K_SUFFIX) for p in prompts)
    assert len(set(prompts)) > 380
    assert D.check_not_evaluation(prompts, D.evaluation_prompts()) == prompts
    assert D.parse_sources("wordmath:2,math:1")  # the CLI's spelling is accepted
