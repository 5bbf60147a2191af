"""The `wordmath` prompt source: multi-step grade-school word problems, composed, with their answers.

The `math` source fills 18 fixed templates, one or two operations each. GSM8K's problems are
varied chains of two to eight steps: a quantity that changes several times, totals over
categories tied by relations ("twice as many", "5 fewer"), rates with a change of units,
discounts, clock times. This source composes such problems from frames and events, each a phrasing
plus the arithmetic it stands for, so every drawn problem is solvable in whole numbers and carries
its answer (`WordProblem.answer`, which tests check; the prompt never shows it). Every prompt ends
with the GSM8K suffix the benchmark uses. Nothing here reads an evaluation set.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_robot.training.prompts import GSM8K_SUFFIX, NAMES

# (plural, singular)
THINGS = (("stickers", "sticker"), ("marbles", "marble"), ("baseball cards", "baseball card"),
          ("seashells", "seashell"), ("cookies", "cookie"), ("pencils", "pencil"), ("stamps", "stamp"),
          ("beads", "bead"), ("tomatoes", "tomato"), ("crayons", "crayon"), ("comic books", "comic book"),
          ("eggs", "egg"), ("candies", "candy"), ("rocks", "rock"), ("postcards", "postcard"))
PURPOSES = ("a school project", "a craft", "a party", "a game with friends", "decorations")
GIFTS = ("a birthday present", "a prize", "a holiday gift", "a thank-you gift")
JOBS = ("mowing lawns", "babysitting", "walking dogs", "selling lemonade", "washing cars", "tutoring")
PURCHASES = ("a book", "lunch", "a movie ticket", "a birthday gift", "art supplies", "a video game",
             "a pair of socks", "a board game")
GOODS = (("notebooks", 2, 6), ("sandwiches", 4, 9), ("T-shirts", 8, 15), ("plants", 3, 12),
         ("comic books", 3, 7), ("bags of chips", 1, 3), ("toy cars", 2, 8), ("posters", 4, 10))
BIG_BUYS = ("bike", "tablet", "guitar", "skateboard", "telescope", "pair of headphones")
FRACTIONS = (("half", 1, 2), ("a third", 1, 3), ("a quarter", 1, 4), ("a fifth", 1, 5),
             ("two thirds", 2, 3), ("three quarters", 3, 4), ("two fifths", 2, 5))


@dataclass(frozen=True)
class WordProblem:
    """One drawn problem: its frame, the question (without the suffix) and its answer."""
    frame: str
    text: str
    answer: int | str


@dataclass(frozen=True)
class Event:
    """One step of a chain: `ok(x, v)` says whether it applies to the running value x with the drawn
    values v (a whole, positive result), `apply` gives the new value, `phrases` the sentences that
    say it ({n} the person, {f} a friend, {things} the object, the drawn values by name). `spends`:
    the step takes from the value (a money question then asks what is left)."""
    name: str
    phrases: tuple[str, ...]
    draw: Callable[[random.Random], dict[str, Any]]
    ok: Callable[[int, dict[str, Any]], bool]
    apply: Callable[[int, dict[str, Any]], int]
    spends: bool = False


def _frac(rng: random.Random) -> dict[str, Any]:
    word, p, q = rng.choice(FRACTIONS)
    return {"frac": word, "p": p, "q": q}


def _goods(rng: random.Random) -> dict[str, Any]:
    goods, lo, hi = rng.choice(GOODS)
    return {"goods": goods, "p": rng.randint(lo, hi), "m": rng.randint(2, 6)}


def _times(rng: random.Random) -> dict[str, Any]:
    word, t = rng.choice((("twice", 2), ("three times", 3)))
    return {"word": word, "t": t}


ITEM_EVENTS = (
    Event("gain", ("{n} buys {k} more {things}.", "{f} gives {n} {k} {things}.", "{n} finds {k} more {things}.",
                   "{n} gets {k} {things} as {gift}."),
          lambda r: {"k": r.randint(2, 30), "gift": r.choice(GIFTS)},
          lambda x, v: True, lambda x, v: x + v["k"]),
    Event("packs", ("{n} buys {m} packs of {things} with {k} {things} in each pack.",
                    "{n} then gets {m} boxes of {things}, and each box holds {k}."),
          lambda r: {"m": r.randint(2, 6), "k": r.randint(3, 12)},
          lambda x, v: True, lambda x, v: x + v["m"] * v["k"]),
    Event("dozen", ("{n} buys {m} dozen {things}.",),
          lambda r: {"m": r.randint(2, 5)}, lambda x, v: True, lambda x, v: x + 12 * v["m"]),
    Event("lose", ("{n} gives {k} {things} to {f}.", "{n} loses {k} {things}.",
                   "{n} uses {k} {things} for {purpose}."),
          lambda r: {"k": r.randint(2, 25), "purpose": r.choice(PURPOSES)},
          lambda x, v: v["k"] < x, lambda x, v: x - v["k"], spends=True),
    Event("part", ("{n} gives {frac} of the {things} to {f}.", "{n} uses {frac} of the {things} for {purpose}."),
          lambda r: {**_frac(r), "purpose": r.choice(PURPOSES)},
          lambda x, v: x % v["q"] == 0, lambda x, v: x - x * v["p"] // v["q"], spends=True),
    Event("times", ("After a trade with {f}, {n} has {word} as many {things} as before.",),
          _times,
          lambda x, v: x * v["t"] <= 400, lambda x, v: x * v["t"]),
)

MONEY_EVENTS = (
    Event("earn", ("{n} earns ${k} {job}.", "{n} gets ${k} for {job}.", "{f} gives {n} ${k}."),
          lambda r: {"k": r.randint(5, 60), "job": r.choice(JOBS)},
          lambda x, v: True, lambda x, v: x + v["k"]),
    Event("hourly", ("{n} works {h} hours {job} at ${r} an hour.",
                     "{n} spends {h} hours {job} and is paid ${r} an hour."),
          lambda r: {"h": r.randint(2, 9), "r": r.randint(6, 18), "job": r.choice(JOBS)},
          lambda x, v: True, lambda x, v: x + v["h"] * v["r"]),
    Event("weekly", ("{n} earns ${k} a week for {w} weeks.",
                     "For {w} weeks, {n} gets ${k} of pocket money every week."),
          lambda r: {"k": r.randint(3, 25), "w": r.randint(2, 8)},
          lambda x, v: True, lambda x, v: x + v["k"] * v["w"]),
    Event("spend", ("{n} spends ${k} on {purchase}.", "{n} pays ${k} for {purchase}."),
          lambda r: {"k": r.randint(4, 45), "purchase": r.choice(PURCHASES)},
          lambda x, v: v["k"] < x, lambda x, v: x - v["k"], spends=True),
    Event("buy", ("{n} buys {m} {goods} for ${p} each.", "{n} buys {m} {goods}, which cost ${p} apiece."),
          _goods, lambda x, v: v["m"] * v["p"] < x, lambda x, v: x - v["m"] * v["p"], spends=True),
    Event("part", ("{n} spends {frac} of the money on {purchase}.", "{n} gives {frac} of the money to {f}."),
          lambda r: {**_frac(r), "purchase": r.choice(PURCHASES)},
          lambda x, v: x % v["q"] == 0, lambda x, v: x - x * v["p"] // v["q"], spends=True),
    Event("percent", ("{n} spends {pct}% of the money on {purchase}.", "{n} donates {pct}% of the money."),
          lambda r: {"pct": r.choice((10, 20, 25, 50)), "purchase": r.choice(PURCHASES)},
          lambda x, v: x * v["pct"] % 100 == 0, lambda x, v: x - x * v["pct"] // 100, spends=True),
)


def _draw_event(rng: random.Random, events: tuple[Event, ...], x: int, last: str) -> tuple[Event, dict[str, Any]]:
    """An event other than `last` that applies to x (each list has events that always apply)."""
    while True:
        ev = rng.choice(events)
        v = ev.draw(rng)
        if ev.name != last and ev.ok(x, v):
            return ev, v


def _chain(rng: random.Random, events: tuple[Event, ...], x: int,
           names: dict[str, str]) -> tuple[list[str], int, bool]:
    """2-4 events applied to x: their sentences, the final value, and whether one of them spent."""
    sentences: list[str] = []
    last, spent = "", False
    for _ in range(rng.randint(2, 4)):
        ev, v = _draw_event(rng, events, x, last)
        sentences.append(rng.choice(ev.phrases).format(**names, **v))
        x, last, spent = ev.apply(x, v), ev.name, spent or ev.spends
    return sentences, x, spent


def _divisor(rng: random.Random, x: int) -> int | None:
    ds = [d for d in range(2, 13) if x % d == 0 and x // d > 1]
    return rng.choice(ds) if ds else None


def items_problem(rng: random.Random) -> WordProblem:
    n, f = rng.sample(NAMES, 2)
    things, thing = rng.choice(THINGS)
    x0 = rng.randint(8, 90)
    start = rng.choice(("{n} has {x} {things}.", "{n} collects {things} and has {x} of them.",
                        "{n} starts the week with {x} {things}."))
    names = {"n": n, "f": f, "things": things, "thing": thing}
    sentences, x, _ = _chain(rng, ITEM_EVENTS, x0, names)
    kind = rng.randrange(4)
    d = _divisor(rng, x)
    if kind == 1 and d:
        q, ans = f"{n} puts all of them into bags of {d}. How many bags does {n} fill?", x // d
    elif kind == 2:
        p = rng.randint(1, 5)
        q, ans = f"{n} sells every {thing} for ${p}. How much money does {n} make?", x * p
    elif kind == 3:
        goal = x + rng.randint(3, 60)
        q, ans = f"{n} wants to have {goal} {things}. How many more does {n} need?", goal - x
    else:
        q, ans = f"How many {things} does {n} have now?", x
    text = " ".join([start.format(x=x0, **names), *sentences, q])
    return WordProblem("items", text, ans)


def money_problem(rng: random.Random) -> WordProblem:
    n, f = rng.sample(NAMES, 2)
    x0 = rng.randint(4, 40) * 5
    start = rng.choice(("{n} has ${x}.", "{n} has ${x} in a piggy bank.", "{n} has saved ${x}."))
    names = {"n": n, "f": f}
    sentences, x, spent = _chain(rng, MONEY_EVENTS, x0, names)
    if rng.random() < 0.35:
        cost = x + rng.randint(5, 120)
        q, ans = (f"{n} wants to buy a {rng.choice(BIG_BUYS)} that costs ${cost}. How much more money does {n} "
                  f"need?"), cost - x
    else:
        q, ans = f"How much money does {n} have {'left' if spent else 'now'}?", x
    return WordProblem("money", " ".join([start.format(x=x0, **names), *sentences, q]), ans)


# place, group word, categories with their legs or wheels (0: none asked), the attribute's name
SETTINGS = (
    ("farm", "animals", (("cows", 4), ("chickens", 2), ("sheep", 4), ("goats", 4), ("ducks", 2), ("pigs", 4)),
     "legs"),
    ("parking lot", "vehicles", (("cars", 4), ("motorcycles", 2), ("bicycles", 2), ("tricycles", 3), ("vans", 4)),
     "wheels"),
    ("garden", "flowers", (("roses", 0), ("tulips", 0), ("daisies", 0), ("sunflowers", 0), ("lilies", 0)), ""),
    ("bookstore", "books", (("novels", 0), ("comic books", 0), ("cookbooks", 0), ("atlases", 0)), ""),
    ("bakery", "baked goods", (("muffins", 0), ("bagels", 0), ("croissants", 0), ("pies", 0)), ""),
    ("pet store", "pets", (("goldfish", 0), ("hamsters", 0), ("parrots", 0), ("rabbits", 0)), ""),
)


@dataclass(frozen=True)
class Relation:
    """A new category's count from an earlier one's (a) and a drawn k: the phrase ({y} the new
    category, {x} the earlier one), the count, and when it is whole and positive."""
    phrase: str
    count: Callable[[int, int], int]
    ok: Callable[[int, int], bool] = lambda a, k: True


RELATIONS = (
    Relation("twice as many {y} as {x}", lambda a, k: 2 * a),
    Relation("three times as many {y} as {x}", lambda a, k: 3 * a),
    Relation("half as many {y} as {x}", lambda a, k: a // 2, lambda a, k: a % 2 == 0),
    Relation("{k} more {y} than {x}", lambda a, k: a + k),
    Relation("{k} fewer {y} than {x}", lambda a, k: a - k, lambda a, k: a - k >= 1),
)


def _join(xs: list[str]) -> str:
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" if k == 1 else f"{k} {word}s"


def totals_problem(rng: random.Random) -> WordProblem:
    place, group, cats, attr = rng.choice(SETTINGS)
    chosen = rng.sample(cats, rng.randint(2, 3))
    counts = [rng.randint(4, 40)]
    parts = [f"A {place} has {counts[0]} {chosen[0][0]}."]
    for name, _ in chosen[1:]:
        j, k = rng.randrange(len(counts)), rng.randint(2, 15)
        rel = rng.choice([r for r in RELATIONS if r.ok(counts[j], k)])  # "twice" always applies
        counts.append(rel.count(counts[j], k))
        parts.append(f"It has {rel.phrase.format(y=name, x=chosen[j][0], k=k)}.")
    kind = rng.randrange(3)
    if kind == 0 and attr:
        q = f"How many {attr} do all the {group} have together?"
        ans = sum(c * a for c, (_, a) in zip(counts, chosen, strict=True))
    elif kind == 1 and not attr:
        prices = [rng.randint(1, 9) for _ in chosen]
        (first, _), *rest = chosen
        later = [f"{c} for ${p}" for (c, _), p in zip(rest, prices[1:], strict=True)]
        parts.append(f"{first.capitalize()} sell for ${prices[0]} each, {_join(later)}.")
        q, ans = (f"If the {place} sells all of them, how much money does it make?",
                  sum(c * p for c, p in zip(counts, prices, strict=True)))
    else:
        q, ans = f"How many {group} does the {place} have in all?", sum(counts)
    return WordProblem("totals", " ".join([*parts, q]), ans)


def rate_problem(rng: random.Random) -> WordProblem:
    n = rng.choice(NAMES)
    kind = rng.randrange(4)
    if kind == 0:
        r = rng.randint(8, 40)
        h = [rng.randint(1, 4) for _ in range(3)]
        total = r * sum(h)
        text = (f"{n} reads {r} pages an hour. {n} reads for {_plural(h[0], 'hour')} on Monday, "
                f"{_plural(h[1], 'hour')} on Tuesday and {_plural(h[2], 'hour')} on Wednesday.")
        if rng.random() < 0.5:
            book = total + rng.randint(10, 200)
            return WordProblem("rate", f"{text} The book has {book} pages. How many pages are left to read?",
                               book - total)
        return WordProblem("rate", f"{text} How many pages does {n} read in the three days?", total)
    if kind == 1:
        widget = rng.choice(("bottles", "toys", "boxes", "bolts", "cups"))
        r, hours, d = rng.randint(2, 15), rng.randint(2, 8), rng.randint(2, 6)
        return WordProblem("rate", f"A machine makes {r} {widget} every minute. It runs for {hours} hours a day. "
                                   f"How many {widget} does it make in {d} days?", r * 60 * hours * d)
    if kind == 2:
        r, fill = rng.choice((5, 10, 12, 15, 20, 25, 30)), rng.randint(1, 6)
        cap = r * 60 * fill
        return WordProblem("rate", f"A hose fills a pool with {r} liters of water per minute. The pool holds {cap} "
                                   f"liters. How many hours does it take to fill the empty pool?", fill)
    v1, h1, v2, h2 = rng.randint(4, 13) * 5, rng.randint(1, 4), rng.randint(4, 13) * 5, rng.randint(1, 4)
    return WordProblem("rate", f"{n} drives at {v1} miles per hour for {_plural(h1, 'hour')}, then at {v2} miles "
                               f"per hour for {_plural(h2, 'hour')}. How many miles does {n} drive in all?",
                       v1 * h1 + v2 * h2)


def discount_problem(rng: random.Random) -> WordProblem:
    n = rng.choice(NAMES)
    goods = rng.choice(("jackets", "lamps", "chairs", "backpacks", "pairs of shoes", "watches"))
    price = rng.randint(1, 12) * 20
    pct = rng.choice((10, 15, 20, 25, 30, 40, 50))
    k = rng.randint(2, 5)
    sale = price * (100 - pct) // 100
    text = f"A store sells {goods} for ${price} each. This week everything is {pct}% off. {n} buys {k} {goods}."
    paid = k * sale
    if rng.random() < 0.4 and paid > 10:
        coupon = rng.randint(1, min(paid // 5, 30))
        text += f" {n} also uses a coupon that takes ${coupon} off the total."
        paid -= coupon
    if rng.random() < 0.5:
        return WordProblem("discount", f"{text} How much does {n} pay?", paid)
    return WordProblem("discount", f"{text} How much money does {n} save compared with the full price?",
                       k * price - paid)


def clock(minutes: int) -> str:
    """Minutes after midnight as '9:05 am' (12-hour clock, within one day)."""
    h, m = divmod(minutes % (24 * 60), 60)
    return f"{(h - 1) % 12 + 1}:{m:02d} {'am' if h < 12 else 'pm'}"


def _duration(m: int) -> str:
    h, r = divmod(m, 60)
    if not h:
        return f"{m} minutes"
    return _plural(h, "hour") + (f" and {r} minutes" if r else "")


def clock_problem(rng: random.Random) -> WordProblem:
    n = rng.choice(NAMES)
    start = rng.randrange(7 * 12, 17 * 12) * 5
    acts = rng.sample(("doing homework", "cleaning the room", "practicing piano", "reading", "cooking dinner",
                       "walking the dog", "painting", "writing a letter"), rng.randint(2, 3))
    mins = [rng.randint(2, 18) * 5 for _ in acts]
    steps = [f"spends {_duration(m)} {a}" for a, m in zip(acts, mins, strict=True)]
    text = f"{n} begins at {clock(start)} and " + ", then ".join(steps) + "."
    if rng.random() < 0.5:
        brk = rng.randint(1, 4) * 5
        text += f" After the first activity, {n} takes one {brk}-minute break."
        mins.append(brk)
    if rng.random() < 0.5:
        return WordProblem("clock", f"{text} At what time does {n} finish?", clock(start + sum(mins)))
    return WordProblem("clock", f"{text} How many minutes pass from start to finish?", sum(mins))


FRAMES: tuple[tuple[Callable[[random.Random], WordProblem], int], ...] = (
    (items_problem, 3), (money_problem, 3), (totals_problem, 2), (rate_problem, 2), (discount_problem, 1),
    (clock_problem, 1))


def draw_problem(rng: random.Random) -> WordProblem:
    fns, weights = zip(*FRAMES, strict=True)
    return rng.choices(fns, weights)[0](rng)


def wordmath_prompts(rng: random.Random, n: int) -> list[str]:
    return [draw_problem(rng).text + GSM8K_SUFFIX for _ in range(n)]
