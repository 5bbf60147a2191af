"""Prompt sources for self-distillation. None of them reads an evaluation set.

Every source is a function `(rng, n) -> list[str]` of plain user turns, except `self`, whose
prompts the target writes itself (it needs the model, see `data.self_written`). Sources:

- `docstring`: functions of the Python standard library and installed numeric packages,
  turned into coding requests, half as a HumanEval-shaped stub (signature + docstring, whole or
  its first paragraph alone, in z-lab's HumanEval wrapper), half as "Write a Python function
  `f(x)` that ...";
- `algo`: small algorithmic problems (lists, strings, digits) composed from a catalogue, as
  HumanEval-shaped stubs whose docstring examples come from a reference (`algo.py`);
- `math`: grade-school word problems filled from templates (names, items, numbers drawn
  at random), with z-lab's GSM8K suffix;
- `wordmath`: multi-step word problems composed from frames and events (a quantity changed
  several times, totals tied by relations, rates with a change of units, discounts, clock times),
  each with its computed answer (`wordmath.py`), with the same suffix;
- `selfmath` / `self`: the target writes a math word problem / a general user turn from a
  topic instruction (Magpie-style), then answers it.

The final refusal check against the installed evaluation sets lives in `data.py`.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import textwrap
from functools import lru_cache

GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_WRAPPER = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                     "```python\n{stub}\n```")

# Modules whose public functions have usable docstrings and import without side effects.
DOC_MODULES = (
    "string", "textwrap", "itertools", "functools", "collections", "math", "statistics", "heapq", "bisect",
    "re", "json", "posixpath", "shutil", "fnmatch", "glob", "datetime", "calendar", "random", "operator",
    "difflib", "html", "urllib.parse", "base64", "binascii", "hashlib", "zlib", "csv", "copy", "pprint",
    "fractions", "decimal", "cmath", "inspect", "typing", "dataclasses", "contextlib", "ast", "tokenize",
    "keyword", "unicodedata", "ipaddress", "uuid", "secrets", "shlex", "email.utils", "configparser",
    "pathlib", "tempfile", "zipfile", "tarfile", "gzip", "struct", "types", "locale", "gettext", "colorsys",
    "quopri", "uu", "wave", "graphlib", "numbers", "abc", "enum", "weakref", "queue", "sched", "platform",
    "sysconfig", "linecache", "codecs", "mimetypes", "netrc", "plistlib", "filecmp", "stat", "getopt",
    "optparse", "argparse", "logging", "warnings", "traceback", "timeit", "doctest", "unittest",
    "numpy", "numpy.linalg", "numpy.fft", "numpy.polynomial.polynomial", "numpy.random",
    "scipy.special", "scipy.stats", "scipy.optimize", "scipy.signal", "scipy.interpolate",
    # added 2026-12-01 (session 10): the pool above had been drawn ~2x over, and 17% of the new
    # docstring samples repeated an earlier one token for token; these double it where installed
    "scipy.linalg", "scipy.integrate", "scipy.spatial.distance", "scipy.ndimage", "numpy.ma", "networkx",
    "networkx.generators", "networkx.algorithms.approximation", "sympy", "pandas", "sklearn.metrics",
    "sklearn.preprocessing", "yaml", "regex", "dateutil.parser", "jinja2", "PIL.ImageOps",
    # added 2026-12-06 (session 39): by shards 1500-1749, 61% of the docstring samples repeated an
    # earlier sample's prompt token for token (a greedy answer to it is the same text again); these,
    # with the methods of the modules' public classes (`documented_functions`), double the pool
    "os", "os.path", "sys", "io", "pickle", "sqlite3", "socket", "http.client", "xml.etree.ElementTree",
    "xml.dom.minidom", "email.message", "asyncio", "concurrent.futures", "threading", "subprocess",
    "multiprocessing", "signal", "ssl", "urllib.request", "xmlrpc.client", "smtplib", "ftplib", "dis",
    "torch", "torch.nn.functional", "tokenizers", "attr", "tqdm", "requests", "packaging.version", "click",
    "rich.text", "matplotlib.colors", "sympy.ntheory", "sympy.combinatorics", "sympy.geometry",
    "sympy.solvers", "sympy.simplify", "sympy.polys", "sympy.matrices", "scipy.sparse", "scipy.sparse.linalg",
    "scipy.cluster.hierarchy", "scipy.fft", "numpy.char", "numpy.testing", "pandas.api.types",
    "sklearn.utils", "sklearn.model_selection", "sklearn.feature_extraction.text", "networkx.algorithms",
    "networkx.utils", "PIL.Image", "PIL.ImageFilter",
)
_DISPATCH = re.compile(r"(\*,\s*)?backend=None,\s*\*\*backend_kwargs")  # networkx's dispatcher


@lru_cache(maxsize=1)
def documented_functions() -> tuple[tuple[str, str, str], ...]:
    """-> ((name, signature, docstring), ...) of public documented functions, sorted, deduplicated.

    The functions of `DOC_MODULES`, then the methods of the public classes each module defines
    (a method as a plain function: `self` / `cls` dropped from its signature). A name is kept
    once, the first module's; a method's key is `Class.method`, so `Series.var` and `DataFrame.var`
    both count, and give the same request only where their signature and docstring are the same."""
    seen: dict[str, tuple[str, str, str]] = {}
    classes: list[tuple[str, type]] = []
    for mod_name in DOC_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - an optional package or a platform-specific module
            continue
        top = mod_name.split(".")[0]
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not callable(obj) or name in seen:
                continue
            if inspect.isclass(obj) and (getattr(obj, "__module__", "") or "").split(".")[0] == top:
                classes.append((name, obj))
            entry = _documented(name, obj)
            if entry is not None:
                seen[name] = entry
    for cname, cls in classes:
        for name, obj in sorted(vars(cls).items()):
            key = f"{cname}.{name}"
            if name.startswith("_") or not callable(obj) or key in seen:
                continue
            entry = _documented(name, obj, method=True)
            if entry is not None:
                seen[key] = entry
    return tuple(sorted(set(seen.values())))


def _documented(name: str, obj: object, method: bool = False) -> tuple[str, str, str] | None:
    """(name, signature, docstring) of a callable with a usable docstring and a short signature."""
    try:  # third-party objects: introspection may raise anything; such a callable is left out
        doc = inspect.getdoc(obj) or ""
        first = doc.split("\n\n")[0].strip()
        if len(first) < 30 or len(doc) > 4000:
            return None
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001
        return None
    if method:
        sig = re.sub(r"^\((self|cls)(,\s*|\))", lambda m: "(" if m.group(2) != ")" else "()", sig)
        sig = re.sub(r"^\(/(,\s*|(?=\)))", "(", sig)  # `(self, /, x)`: no positional-only marker left first
    sig = plain_signature(sig)
    if len(sig) > 120 or "<" in sig:
        return None
    return name, sig, _clean_doc(doc)


def plain_signature(sig: str) -> str:
    """A signature as a user would write it: without networkx's dispatch parameters."""
    return re.sub(r"(,\s*)+\)$", ")", _DISPATCH.sub("", sig)).replace("(, ", "(")


def _clean_doc(doc: str) -> str:
    paras = [p for p in doc.split("\n\n") if p.strip()]
    keep, size = [], 0
    for p in paras:  # the summary, then paragraphs while short; examples are kept when they fit
        if size + len(p) > 700:
            break
        keep.append(p)
        size += len(p)
    return "\n\n".join(keep) or paras[0][:700]


def _summary(doc: str) -> str:
    s = re.sub(r"\s+", " ", doc.split("\n\n")[0]).strip().rstrip(".")
    return s[0].lower() + s[1:] if s[:1].isupper() and not s[1:2].isupper() else s


def humaneval_stub(name: str, sig: str, doc: str, summary_only: bool = False) -> str:
    """`def name(sig):` and its docstring, as in a HumanEval problem. `summary_only` keeps the first
    paragraph alone: a second stub per function wherever the docstring has more than one paragraph
    (with one paragraph both forms are the same prompt, which generation skips as a repeat)."""
    body = textwrap.indent(doc.split("\n\n")[0] if summary_only else doc, "    ")
    return f'def {name}{sig}:\n    """{body.strip()}\n    """\n'


def docstring_prompts(rng: random.Random, n: int) -> list[str]:
    funcs = documented_functions()
    out = []
    for _ in range(n):
        name, sig, doc = rng.choice(funcs)
        if rng.random() < 0.5:
            out.append(HUMANEVAL_WRAPPER.format(stub=humaneval_stub(name, sig, doc, summary_only=rng.random() < 0.5)))
        else:
            verb = rng.choice(["Write a Python function", "Implement a Python function",
                               "Write a function in Python", "Create a Python function"])
            extra = rng.choice(["", " Include a short docstring.", " Explain your code briefly.",
                                " Add a few test cases.", " Do not use any library."])
            out.append(f"{verb} `{name}{sig}` that does the following: {_summary(doc)}.{extra}")
    return out


NAMES = ["Ava", "Ben", "Carla", "Deepak", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kate", "Luis",
         "Mei", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe"]
ITEMS = [("apples", 1), ("pencils", 2), ("stickers", 1), ("cookies", 2), ("marbles", 1), ("books", 12),
         ("toy cars", 6), ("cupcakes", 3), ("notebooks", 4), ("oranges", 1), ("cards", 1), ("flowers", 3)]
PLACES = ["the market", "a bakery", "the school fair", "a bookstore", "the farm", "a toy shop", "the library sale"]

MATH_TEMPLATES = (
    "{n1} has {a} {item}. {p2} gives {n1} {b} more, and then {n1} gives away {c}. How many {item} does {n1} have now?",
    "{n1} buys {a} packs of {item} at {place}. Each pack holds {b} {item}. {n1} uses {c} of them. "
    "How many {item} are left?",
    "At {place}, {item} cost ${price} each. {n1} buys {a} and pays with a ${bill} bill. How much change does "
    "{n1} get?",
    "{n1} saves ${a} every week. After {b} weeks, {n1} spends ${c} on a gift. How much money is left?",
    "A class of {big} students is split into groups of {b}. How many full groups are there, and how many "
    "students are left over?",
    "{n1} reads {a} pages on Monday and twice as many on Tuesday. On Wednesday {n1} reads {c} pages. "
    "How many pages did {n1} read in the three days?",
    "A recipe needs {b} cups of flour for {a} cookies. How many cups of flour are needed for {big} cookies?",
    "{n1} runs {a} miles a day for {b} days, and {p2} runs {c} miles a day for {d} days. Who runs farther, "
    "and by how many miles?",
    "A shirt costs ${price0}. It is on sale for {pct}% off. {n1} buys {b} shirts. How much does {n1} pay?",
    "{n1} is {a} years old. {p2} is {b} years older than {n1}. In {c} years, what will the sum of their ages be?",
    "A tank holds {big} liters of water. It leaks {b} liters every hour. After {c} hours, {a} liters are "
    "added. How much water is in the tank?",
    "{n1} earns ${price} per hour and works {a} hours a day, {b} days a week. How much does {n1} earn in "
    "{c} weeks?",
    "There are {a} red, {b} blue and {c} green {item} in a box. What fraction of the {item} are blue?",
    "A train travels {big} miles in {b} hours. At the same speed, how far does it travel in {c} hours?",
    "{n1} has ${big}. {n1} spends a quarter of it on {item} and then half of what is left at {place}. "
    "How much money does {n1} have left?",
    "The sum of two numbers is {big} and their difference is {b}. What are the two numbers?",
    "A rectangle is {a} cm long and {b} cm wide. A square has the same perimeter. What is the area of "
    "the square?",
    "{n1} scored {a}, {b}, {c} and {d} points in four games. How many points does {n1} need in the fifth "
    "game to average {avg} points?",
)


def math_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        n1, p2 = rng.sample(NAMES, 2)
        item, _ = rng.choice(ITEMS)
        a, b, c, d = (rng.randint(2, 40) for _ in range(4))
        vals = dict(n1=n1, p2=p2, item=item, place=rng.choice(PLACES), a=a, b=b, c=min(c, a * b), d=d,
                    big=rng.randint(41, 500), price=rng.randint(2, 25), bill=rng.choice([50, 100]),
                    price0=rng.randint(10, 80), pct=rng.choice([10, 20, 25, 30, 50]),
                    avg=rng.randint(10, 30))
        out.append(rng.choice(MATH_TEMPLATES).format(**vals) + GSM8K_SUFFIX)
    return out


MATH_TOPICS = ["shopping", "cooking", "travel", "saving money", "a school trip", "gardening", "sports scores",
               "building a fence", "a bake sale", "time and speed", "sharing candy", "a farm", "painting a room",
               "a birthday party", "a library", "fuel and distance", "percentages and discounts", "ages"]
MATH_SHAPES = ["two steps", "three steps", "multiplication and subtraction", "division with a remainder",
               "fractions", "a percentage", "rates", "an average", "money and change"]


def selfmath_instructions(rng: random.Random, n: int) -> list[str]:
    """User turns asking the target to write a word problem (its answer becomes a prompt)."""
    return [f"Write one grade-school math word problem about {rng.choice(MATH_TOPICS)} that needs "
            f"{rng.choice(MATH_SHAPES)} to solve. Write only the problem, not the solution." for _ in range(n)]


def algo_prompts(rng: random.Random, n: int) -> list[str]:
    from dflash_robot.training import algo  # algo builds on this module's stub and wrapper

    return algo.algo_prompts(rng, n)


def wordmath_prompts(rng: random.Random, n: int) -> list[str]:
    from dflash_robot.training import wordmath  # wordmath builds on this module's names and suffix

    return wordmath.wordmath_prompts(rng, n)


STATIC_SOURCES = {"docstring": docstring_prompts, "math": math_prompts, "algo": algo_prompts,
                  "wordmath": wordmath_prompts}
SOURCES = ("docstring", "math", "algo", "wordmath", "selfmath", "self")
